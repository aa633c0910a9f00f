"""attribution_svc: raw concept records -> labelled token/chunk attributions (cde.v1.Attribution).

    python -m attribution_svc --model-dir models/steerling-tiny --port 50071

`compute` holds the math and the per-stream chunk state (no gRPC); `service` wraps it in a
grpc.aio server (`build_server`, `serve`).
"""
