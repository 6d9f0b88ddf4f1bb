"""The pre-flight check (`python -m lclm.check --config FILE`): before renting hardware, run
the config's model, data and attention on the devices at hand for a few rows and check what
a misconfigured long-context run gets wrong first. `setup` decides what runs (the mesh
shrunk to the devices there are, the lengths, the first weights, rows of the real data);
`checks` holds the three checks; `__main__` the command line.
"""
