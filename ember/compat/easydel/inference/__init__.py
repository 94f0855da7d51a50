"""``easydel.inference`` on ember: the modules scripts import by path (``easydel.inference.sampling_params``)."""
