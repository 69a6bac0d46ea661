"""`rlcore.compat`: other frameworks' configs read as rlcore's. `ms_swift` translates ms-swift's keys and YAML forms,
`trl_names` TRL's names; the CLI runs them before a config is validated (`ms_swift.load_translated`).
"""
