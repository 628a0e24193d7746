"""A notebook's training function as a job: `ddpnb.export` writes it, with what it uses from the notebook, as a
standalone script that torchrun or srun runs (`sources` finds the definitions, `writer` writes the files), and
`runtime` is what such a script calls so that `ddpnb.log`, `ddpnb.device` and the checkpoints work in it.

This package is not imported by `import ddpnb`; `ddpnb.export` and `%ddp_export` import it when called."""
