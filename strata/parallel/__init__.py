"""A model's layers on several devices or processes: stage plans, stages, the split pool, links."""
