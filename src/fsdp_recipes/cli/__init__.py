"""`fsdp-recipes <command>`: the one command line over the launcher, the planner and the tools."""
