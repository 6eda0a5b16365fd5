"""The scheduled upkeep the job types' hooks drive: reconciliation and compensation
(:mod:`engine.upkeep.reconciliation`), retention (:mod:`engine.upkeep.retention`) and cache
warming (:mod:`engine.upkeep.warming`)."""
