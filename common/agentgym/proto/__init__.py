"""Generated protobuf/gRPC code for the platform's contracts (sources in `proto/`).

Regenerate with `make proto`; `tests/common/test_proto_current.py` fails when these files are stale.
"""
