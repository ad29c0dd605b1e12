"""Studies of distillation quality (not product benchmarks): each runs as
``python -m experiments.<study>`` from the repository root and writes its pages under
``experiments/results/``. ``distill``: held-out KL of offline methods vs online KD over paired
seeds; ``sampled_head``: the variance of sampled targets; ``vllm_sampling``: sampling inside vLLM.
"""
