"""steering_svc: the concept catalog and steering vectors as the cde.v1.Steering gRPC service.

    python -m steering_svc --model-dir models/steerling-tiny --port 50061

`backend.SteeringBackend` holds the catalog and two memory-mapped checkpoint tensors and
implements the rules; `service` wraps it in a grpc.aio server (`build_server`, `serve`).
"""
