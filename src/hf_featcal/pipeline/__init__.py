"""The stages of a FeatCal run, one file each (see docs/how-featcal-works.md):

plan → enter → capture → accumulate → solve → write → propagate → drift → checkpoint,
sharing a `RunContext` (context.py). `FeatCalCalibrator` (calibrator.py) runs them block by block.
"""
