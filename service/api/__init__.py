"""The HTTP side: the app factory (`app`), `reformer serve` (`server`), the ASGI middlewares, the state the
routes share, the thin routers (`routes/`) and the request and response models (`protocol/`).

May import every other folder of the service (engine, prefix_cache, observability, text) and the shared base
(`service.settings`, `service.errors`, `service.jobs`, `service.memory`); nothing below imports it."""
