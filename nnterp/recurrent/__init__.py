"""The machinery every recurrent mixer shares, below the components that declare values.

* `kernels`: what a modeling module binds its kernel names to (transformers'
  hub dispatcher, a bare pure-torch function, the HF ``kernels`` package);
* `labels`: the nnsight labels found in the installed release's source, one
  frozen `KernelLabels` record per (component, HF mixer class);
* `routing`: `route_kernels`, the process-wide binding of a family's kernels;
* `arguments`: one signature table per kernel (a value's name -> where the
  call holds it and in which layout), and the step size Δ and its inverse;
* `call`: the per-call record every per-token strategy keeps, and its order checks
  (`forward_call`: lightning attention's, built from its forward's own operations);
* `settings`: the per-model settings nnterp keeps on its own envoys
  (`fast_states`, `chunk_per_token`);
* `per_token`: the three ways to the state after every token.

Nothing here imports a component or a family.
"""
