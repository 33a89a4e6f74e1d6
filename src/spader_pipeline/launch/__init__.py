"""Launchers for GPU-cluster training: VERL's ``main_ppo`` (:mod:`.verl`) and its checkpoint merger (:mod:`.merge`)."""
