"""Building and starting GPU-cluster runs: VERL's ``main_ppo`` command line (:mod:`.overrides`), its
launch (:mod:`.verl`) and its checkpoint merger (:mod:`.merge`). What verl itself calls lives in
:mod:`spader_pipeline.verl_plugin`."""
