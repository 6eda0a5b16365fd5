"""What the platform says about itself: the diagnosis checklist (:mod:`engine.health.diagnosis`),
the metrics (:mod:`engine.health.metrics`), and both built from one configuration
(:mod:`engine.health.observability`)."""
