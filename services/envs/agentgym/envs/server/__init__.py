"""The environment-service framework: one process hosts many live episodes of one kind.

`EpisodeManager` holds the episodes and the bounds; `http_api.create_app` and
`grpc_api.create_grpc_server` are two front ends over it; `serve` runs both.
"""
