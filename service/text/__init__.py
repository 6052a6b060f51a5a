"""Text handling: tokenizing off the event loop, incremental detokenizing, and chat rendering (the artifact's
Jinja template, and the prompt ids with control tokens kept apart from what the client wrote).

May import the shared base (`service.errors`) only."""
