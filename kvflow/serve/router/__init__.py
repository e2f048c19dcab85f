"""The router: HTTP app (:mod:`.app`, :mod:`.api`, :mod:`.errors`), request orchestration
(:mod:`.router`), the ZMQ control plane (:mod:`.control`), placement, liveness and metrics."""
