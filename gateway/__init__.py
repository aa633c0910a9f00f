"""The gateway: public REST (OpenAI-compatible) and gRPC APIs in front of scheduler_svc.

Entry points: `gateway.server.serve(settings) -> GatewayHandle` (in-process), `gateway.app.build_app`
(the FastAPI app alone), `python -m gateway` (a process). Module map in docs/ARCHITECTURE.md.
"""
