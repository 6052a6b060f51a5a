"""Thin routers: validate with the protocol models, hand specs to the engine, shape the answers."""
