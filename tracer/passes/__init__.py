"""Pure functions over a `StepGraph`: liveness, categories, saved tensors, attribution, the analysis."""
