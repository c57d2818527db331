"""The REST API (FastAPI, under ``/v1``) and the job service it shares with the Studio UI.

``service`` has no HTTP in it (the UI calls it directly); ``app.create_app`` builds the FastAPI app;
``server.run_api`` serves it with uvicorn.
"""
