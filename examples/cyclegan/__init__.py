"""CycleGAN (unpaired image-to-image translation) on any ``torch_distribute`` strategy.

The TensorFlow CycleGAN tutorial (horse2zebra), converted to a strategy-agnostic custom loop:
the same program runs under ``OneDeviceStrategy``, ``MirroredStrategy`` (GPUs or CPU
replicas) and ``MultiWorkerMirroredStrategy``.

Modules, one concept each:

* ``data``    -- the two image domains (CycleGAN folders or the packaged digits), jitter, loaders
* ``models``  -- ResNet generators G: X->Y, F: Y->X and PatchGAN discriminators D_X, D_Y
* ``losses``  -- per-sample adversarial (LSGAN/BCE), cycle and identity losses, MAE
* ``steps``   -- the four models and optimizers, ``train_step``/``test_step``, ``reduce_dict``
* ``plots``   -- translation grids and loss curves (matplotlib, no display needed)
* ``train``   -- the command line training loop (progress bars, TensorBoard, checkpoints)
* ``compare`` -- 1 vs 2 replicas at the same global batch: loss curves, parameters, speed

    python -m examples.cyclegan.train                        # packaged digits, 2 CPU replicas
    python -m examples.cyclegan.train --strategy one --epochs 3
    python -m examples.cyclegan.train --strategy one --compile    # td.function, as @tf.function
    python -m examples.cyclegan.train --data-dir ~/horse2zebra --image-size 256 \\
        --generator-filters 64 --residual-blocks 9 --batch-size-per-replica 1
    python -m torch_distribute.launch --nproc 2 -m examples.cyclegan.train --strategy multiworker
    python -m examples.cyclegan.compare
"""
