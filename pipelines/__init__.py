"""Job types, assets, schedules and the Definitions of sekali."""
