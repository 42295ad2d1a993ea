"""The Hydra configs shipped with the package (`pkg://gem_lp.configs`): config.yaml and its groups."""
