"""Deep Search: answer questions by searching a Wikipedia corpus over several turns (Search-R1 style).

Modules: `corpus` (passages in wiki-18 format), `index` (the cached BM25 index), `retriever`
(Search-R1's ``POST /retrieve`` service and its clients), `scoring` (answer normalisation, EM/F1,
answer-set match), `tasks` (the shipped FanOutQA sets and user-supplied files), `env`, `expert`,
`compat` (AgentGym SearchQA routes).
"""
