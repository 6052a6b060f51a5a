"""reformer-serve's service, one folder per job, each importing only the folders below it
(tests/test_import_graph.py holds the order):

- `api/`: the HTTP side (app factory, server, middlewares, routes, protocol models); on top.
- `engine/`: the worker thread that owns the model: admission, policy, per-step work, runner, backends.
- `prefix_cache/`: kept decode states of prompts, in memory and on disk.
- `observability/`: metrics, tracing and logs.
- `text/`: tokenizing, detokenizing, chat rendering.
- the shared base, at this level: `settings` (every setting, one file), `errors` (the error types every layer
  raises, and their HTTP answers), `jobs` (the specs the HTTP side hands the engine and what comes back) and
  `memory` (the host's and container's memory, the heap); they import no folder of the service.
- `cli` and `__main__`: the command line's entry points.
"""
