"""Pure algorithms core: answer matching, step segmentation, rewards and advantage estimators.

Only numpy, torch, pyahocorasick and the standard library are imported here (no verl, Ray, Kedro or
HTTP), so the native trainer and the VERL plugin share exactly one implementation.
"""
