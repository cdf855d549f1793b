"""Evaluation of attention (Brauwers Sec. 4; Galassi V-VI): capture the weights of any model
built from attnkit parts, intrinsic metrics against gold attention, the uniform-weights
ablation, supervised attention, and the "is attention explanation?" toolkit: importance
measures and their agreement with attention, counterfactual weights, erasure, heads, effective
attention, attention rollout and flow, attention as confidence, and the extrinsic metrics BLEU,
METEOR, WER, PER, perplexity, precision/recall/F1, PSNR, SSIM and IoU.
:mod:`attnkit.evaluation.bert_heads` applies the head analyses to pretrained BERT-like
``transformers`` models."""

from attnkit.evaluation.ablation import uniform_weights
from attnkit.evaluation.agreement import kendall_tau, top_k_overlap
from attnkit.evaluation.capture import capture
from attnkit.evaluation.classification import precision_recall_f1
from attnkit.evaluation.confidence import attention_confidence, confidence_correlation
from attnkit.evaluation.counterfactual import (
    adversarial_weights,
    edit_weights,
    jensen_shannon,
    permuted_weights,
    total_variation,
    uniform_baseline,
)
from attnkit.evaluation.diagnostics import (
    frozen_weights_probe,
    seed_variance,
    train_adversary,
    uniform_pooling,
)
from attnkit.evaluation.effective import effective_attention
from attnkit.evaluation.erasure import erasure, random_order
from attnkit.evaluation.extrinsic import bleu, perplexity, word_error_rate
from attnkit.evaluation.flow import attention_flow
from attnkit.evaluation.heads import (
    head_gates,
    head_importance_by_gradient,
    head_importance_by_masking,
    head_statistics,
    pruning_curve,
)
from attnkit.evaluation.image_metrics import box_iou, mask_iou, psnr, ssim
from attnkit.evaluation.importance import (
    gradient,
    input_x_gradient,
    integrated_gradients,
    leave_one_out,
)
from attnkit.evaluation.metrics import (
    alignment_error_rate,
    attention_correctness,
    entropy,
    rank_correlation,
)
from attnkit.evaluation.rollout import attention_rollout
from attnkit.evaluation.supervision import supervised_attention_loss
from attnkit.evaluation.text_metrics import (
    meteor,
    meteor_sentence,
    position_independent_error_rate,
)

__all__ = [
    "adversarial_weights",
    "alignment_error_rate",
    "attention_confidence",
    "attention_correctness",
    "attention_flow",
    "attention_rollout",
    "bleu",
    "box_iou",
    "capture",
    "confidence_correlation",
    "edit_weights",
    "effective_attention",
    "entropy",
    "erasure",
    "frozen_weights_probe",
    "gradient",
    "head_gates",
    "head_importance_by_gradient",
    "head_importance_by_masking",
    "head_statistics",
    "input_x_gradient",
    "integrated_gradients",
    "jensen_shannon",
    "kendall_tau",
    "leave_one_out",
    "mask_iou",
    "meteor",
    "meteor_sentence",
    "permuted_weights",
    "perplexity",
    "position_independent_error_rate",
    "precision_recall_f1",
    "pruning_curve",
    "psnr",
    "random_order",
    "rank_correlation",
    "seed_variance",
    "ssim",
    "supervised_attention_loss",
    "top_k_overlap",
    "total_variation",
    "train_adversary",
    "uniform_baseline",
    "uniform_pooling",
    "uniform_weights",
    "word_error_rate",
]
