"""Building and starting GPU-cluster runs. A verl launch (:mod:`.verl`, the order of its steps) is
made of its typed settings (:mod:`.settings`), Kedro parameters → ``main_ppo``'s Hydra overrides
(:mod:`.overrides`), the command line and environment (:mod:`.command`), the data files it reads
(:mod:`.data_files`), the process runner (:mod:`.process`) and the follower of its metrics files
(:mod:`.metrics`); :mod:`.merge` runs verl's checkpoint merger. What verl itself calls lives in
:mod:`spader_pipeline.verl_plugin`."""
