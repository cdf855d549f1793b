"""Training with and through attention (Galassi V-A, VI; Brauwers Sec. 4): attention energies
trained beforehand and plugged into another model (preliminary training), supervision of one
head of a Transformer stack (LISA), attention distillation, attention weights as the features of
a probe, attention over training samples (outliers, sample weights), attention alignment across
domains, and logical rules on attention as penalties.

:func:`capture_weights` gives the weights of every attention module of a model *with* their
graph (:func:`attnkit.evaluation.capture` gives them detached), which the losses here need.
"""

from attnkit.training.attention_rules import (
    monotone_rate,
    monotonicity_violation,
    one_to_one_rate,
    one_to_one_violation,
    rule_bias,
)
from attnkit.training.distillation import attention_distillation_loss, distill
from attnkit.training.domain_alignment import align_attention, attention_alignment_loss
from attnkit.training.graph_capture import attention_modules, capture_weights, stack_head_weights
from attnkit.training.head_supervision import head_supervision_loss, parent_accuracy, parent_loss
from attnkit.training.pretrained_energies import EnergyAttention, PretrainedEnergies, freeze
from attnkit.training.probes import (
    AttentionProbe,
    fit_probe,
    pair_features,
    probe_accuracy,
    stack_heads,
)
from attnkit.training.sample_attention import SampleAttention, SampleAttentionOutput
from attnkit.training.synthetic import (
    ParentTask,
    SignalTask,
    parent_sequences,
    signal_sequences,
)
from attnkit.training.weight_matching import Matched, match_heads, run_matched, uniform_pairs

__all__ = [
    "AttentionProbe",
    "EnergyAttention",
    "Matched",
    "ParentTask",
    "PretrainedEnergies",
    "SampleAttention",
    "SampleAttentionOutput",
    "SignalTask",
    "align_attention",
    "attention_alignment_loss",
    "attention_distillation_loss",
    "attention_modules",
    "capture_weights",
    "distill",
    "fit_probe",
    "freeze",
    "head_supervision_loss",
    "match_heads",
    "monotone_rate",
    "monotonicity_violation",
    "one_to_one_rate",
    "one_to_one_violation",
    "pair_features",
    "parent_accuracy",
    "parent_loss",
    "parent_sequences",
    "probe_accuracy",
    "rule_bias",
    "run_matched",
    "signal_sequences",
    "stack_head_weights",
    "stack_heads",
    "uniform_pairs",
]
