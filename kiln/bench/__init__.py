"""`kiln bench`: side-by-side training benchmarks of eager PyTorch, torch.compile and Kiln.

Modules, in the order a run uses them:

* ``cli``     - the ``kiln bench`` / ``kiln bench report`` command line;
* ``zoo``     - models built from configs with random weights, their batches and
  analytic FLOP counts (``flops``, ``cnn`` for the plain-torch ResNet);
* ``runner``  - one fresh ``worker`` process per mode, progress, timeouts, ratios;
* ``worker``  - trains one mode (``modes``) and measures it (``memory`` for peak RSS);
* ``peak``    - the machine's peak matmul rate per dtype, the "% of peak" denominator;
* ``render``, ``plot``, ``report`` - terminal table, PNG chart, Markdown.
"""
