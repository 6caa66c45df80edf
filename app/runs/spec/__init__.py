"""The run spec: the body of ``POST /runs`` (:mod:`.body`) and its parts, each a module of
its own (GRPO settings, rewards, environments, the SFT warm-up, a teacher run), validated
when a run is created; and the same spec as a worker reads a stored run back
(:mod:`.parsed`). Nothing here touches the database or HTTP.
"""
