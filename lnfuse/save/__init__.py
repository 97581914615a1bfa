"""Save: staged, all-or-nothing writes of the output files, and what lnfuse did recorded in the model itself."""
