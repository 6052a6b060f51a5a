"""`reformer loadtest`: drive a running server with long documents and report what it did (loadtest/cli.py
is the command). A client of the service over HTTP only: it imports nothing else of the project, so it runs
without torch, against any server it can reach."""
