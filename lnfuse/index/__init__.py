"""Index: what is known about a model before it runs (constants, shapes, on demand and under a budget) and the exporter
quirks removed before matching."""
