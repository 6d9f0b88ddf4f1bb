"""A whole context extension in one command (`python -m lclm.extend`): the starting weights
measured, every stage trained, the trained weights measured, one report with before and after
side by side and a verdict on each target. `plan` (the parts and their order), `heldout` (the
documents measured on), `timing` (each part's expected time), `targets` (the verdicts),
`report` (the files), `__main__` (the command)."""
