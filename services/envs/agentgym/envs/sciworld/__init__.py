"""SciWorld: ScienceWorld's simulator (the `scienceworld` wheel's jar on Java 17) as an environment.

`env.SciWorldEnv` is one episode; `pool.SciWorldPool` keeps warm simulators, several to a
heap-capped JVM (`jvm`), that episodes lease; `tasks.SciWorldCatalog` lists the 30 tasks x
variations and their splits; `expert` replays ScienceWorld's gold action sequences; `compat` serves
AgentGym's SciWorld routes.
"""
