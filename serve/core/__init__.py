"""What every part of the engine passes around: a sequence and its request's state, outputs as they
are built, the stats, fault containment, structured-output specs, detokenizing, and token trees.
Nothing here imports the scheduler, the runner or the engine."""
