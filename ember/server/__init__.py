"""ember's OpenAI-compatible HTTP server (``ember serve``): a front end over ``EngineClient`` like ``LLM``, built on
FastAPI + uvicorn, Server-Sent Events and prometheus-client. ``build_app(models, settings)`` makes the ASGI app;
``ember.server.launch`` runs it. See docs/server.md."""
