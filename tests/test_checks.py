"""Bad calls raise ValueError/TypeError whose message names the argument and the shapes."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit import alignments as al
from attnkit import checks, masks
from attnkit import features as ft
from attnkit import queries as qr
from attnkit import scores as sc
from attnkit.layers import HeadwiseLinear
from attnkit.models import Seq2SeqAttention
from attnkit.transformer import TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer


def q_(*s, dtype=torch.float32):
    return torch.randn(*s, dtype=dtype)


def b_(*s):
    return torch.ones(*s, dtype=torch.bool)


BAD_CALLS = [
    ("q of rank 1", lambda: ak.attention(q_(4), q_(2, 5, 4)), ValueError, r"q must have at least 2 dims.*\(4,\)"),
    ("k of rank 1", lambda: ak.attention(q_(2, 3, 4), q_(4)), ValueError, r"k must have at least 2 dims"),
    ("d_q != d_k for dot", lambda: ak.attention(q_(2, 3, 5), q_(2, 6, 4), score="dot"), ValueError, r"d_q == d_k.*\(2, 3, 5\).*\(2, 6, 4\)"),
    ("d_q != d_k for scaled_dot", lambda: ak.attention(q_(2, 3, 5), q_(2, 6, 4)), ValueError, r"d_q == d_k"),
    ("v length != k length", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), q_(2, 5, 3)), ValueError, r"v has 5 values \(shape \(2, 5, 3\)\) but k has 6 keys"),
    ("mask of wrong shape", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), mask=torch.ones(2, 3, 5, dtype=torch.bool)), ValueError, r"mask of shape \(2, 3, 5\) does not broadcast.*\(2, 3, 6\)"),
    ("mask with too many dims", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), mask=torch.ones(1, 2, 3, 6, dtype=torch.bool)), ValueError, r"mask of shape \(1, 2, 3, 6\)"),
    ("mask of float dtype", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), mask=torch.ones(2, 3, 6)), TypeError, r"mask must be boolean.*torch.float32"),
    ("mask not a tensor", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), mask=[[True]]), TypeError, r"mask must be a torch.Tensor"),
    ("integer q", lambda: ak.attention(torch.ones(2, 3, 4, dtype=torch.long), q_(2, 6, 4)), TypeError, r"q must be a floating-point tensor, got dtype torch.int64"),
    ("integer v", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), torch.ones(2, 6, 4, dtype=torch.int32)), TypeError, r"v must be a floating-point"),
    ("N = 0", lambda: ak.attention(q_(2, 3, 4), q_(2, 0, 4)), ValueError, r"k has no keys \(N = 0, shape \(2, 0, 4\)\)"),
    ("unknown score name", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), score="scaled_dott"), ValueError, r"unknown score 'scaled_dott'; did you mean 'scaled_dot'\?"),
    ("unknown alignment name", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), align="softmx"), ValueError, r"unknown alignment 'softmx'; did you mean 'softmax'\?.*sparsemax"),
    ("parametrised score by name", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), score="additive"), TypeError, r"score 'additive' has parameters"),
    ("unknown kwarg to build", lambda: ak.scores.build("additive", d_q=4, d_k=4, d_ww=8), TypeError, r"score 'additive'.*d_ww"),
    ("missing kwarg to build", lambda: ak.scores.build("general", d_q=4), TypeError, r"score 'general'.*d_k"),
    ("mixed dtypes", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4, dtype=torch.float64)), TypeError, r"k has dtype torch.float64 but q has torch.float32"),
    ("mixed devices", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4).to("meta")), ValueError, r"k is on meta but q is on cpu"),
    ("batch dims do not broadcast", lambda: ak.attention(q_(2, 3, 4), q_(3, 6, 4)), ValueError, r"batch dims of q \(2, 3, 4\), k \(3, 6, 4\)"),
    ("bias of wrong shape", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), bias=torch.zeros(3, 5)), ValueError, r"bias of shape \(3, 5\) does not broadcast"),
    ("multi-dim score with wrong d_v", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), q_(2, 6, 5), score=ak.scores.Additive(4, 4, 8, d_out=3)), ValueError, r"d_out = 3.*d_v = 5"),
    ("q=None for a score that needs a query", lambda: ak.attention(None, q_(2, 6, 4)), ValueError, r"q is None but the ScaledDot score needs a query"),
    ("score of the wrong type", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), score=torch.nn.Linear(2, 2)), TypeError, r"score must be a registered name or an attnkit Score"),
    ("chunk_size not positive", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), score="dot", align="sparsemax", chunk_size=-1), ValueError, r"chunk_size must be a positive int, got -1"),
    ("chunk_size with a non-streaming alignment", lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), align="reinforced", chunk_size=2), ValueError, r"kernel .chunked. cannot evaluate this call: the Reinforced alignment does not implement the streaming protocol"),
    ("embed_dim not divisible", lambda: ak.MultiHeadAttention(10, 3), ValueError, r"embed_dim = 10 is not divisible by num_heads = 3"),
    ("MHA query of wrong width", lambda: ak.MultiHeadAttention(8, 2)(q_(2, 3, 6)), ValueError, r"query has 6 features \(shape \(2, 3, 6\)\) but this MultiHeadAttention expects 8"),
    ("MHA key of wrong width", lambda: ak.MultiHeadAttention(8, 2, kdim=5)(q_(2, 3, 8), q_(2, 4, 8), q_(2, 4, 8)), ValueError, r"key has 8 features.*expects 5"),
    ("negative dropout", lambda: ak.Attention(dropout=-0.1), ValueError, r"dropout must be in \[0, 1\)"),
    ("location score beyond max_len", lambda: ak.attention(q_(2, 3, 4), q_(2, 9, 4), score=ak.scores.Location(4, 8)), ValueError, r"N = 9 keys.*max_len = 8"),
    ("negative window", lambda: ak.alignments.Local(-1), ValueError, r"window must be an int >= 0, got -1"),
    ("unknown activation", lambda: ak.scores.Additive(4, 4, 8, activation="tanhh"), ValueError, r"unknown activation 'tanhh'"),
    # Constructor arguments name the argument the caller wrote, and a bool is not an int.
    ("Additive d_w=0", lambda: sc.Additive(4, 4, 0), ValueError, r"d_w must be a positive int, got 0"),
    ("Additive d_q=0", lambda: sc.Additive(0, 4, 4), ValueError, r"d_q must be a positive int or None, got 0"),
    ("Additive d_k=-1", lambda: sc.Additive(4, -1, 4), ValueError, r"d_k must be a positive int, got -1"),
    ("Additive d_out=0", lambda: sc.Additive(4, 4, 4, d_out=0), ValueError, r"d_out must be a positive int or None, got 0"),
    ("Additive d_w float", lambda: sc.Additive(4, 4, 4.0), ValueError, r"d_w must be a positive int, got 4.0"),
    ("Additive num_heads=0", lambda: sc.Additive(4, 4, 4, num_heads=0), ValueError, r"num_heads must be a positive int or None, got 0"),
    ("Additive num_heads=True", lambda: sc.Additive(4, 4, 4, num_heads=True), ValueError, r"num_heads must be a positive int or None, got True"),
    ("activation not a name", lambda: sc.Additive(4, 4, 4, activation=3), TypeError, r"activation must be a name .* or a callable, got 3"),
    ("Concat d_w=0", lambda: sc.Concat(4, 4, 0), ValueError, r"d_w must be a positive int, got 0"),
    ("Deep depth=0", lambda: sc.Deep(4, 4, 4, depth=0), ValueError, r"depth must be a positive int, got 0"),
    ("Deep depth=True", lambda: sc.Deep(4, 4, 4, depth=True), ValueError, r"depth must be a positive int, got True"),
    ("General d_q=0", lambda: sc.General(0, 4), ValueError, r"d_q must be a positive int, got 0"),
    ("BiasedGeneral d_k=-2", lambda: sc.BiasedGeneral(4, -2), ValueError, r"d_k must be a positive int, got -2"),
    ("ActivatedGeneral activation", lambda: sc.ActivatedGeneral(4, 4, activation="x"), ValueError, r"unknown activation 'x'"),
    ("Location max_len=0", lambda: sc.Location(4, 0), ValueError, r"max_len must be a positive int, got 0"),
    ("Location d_q=0", lambda: sc.Location(0, 4), ValueError, r"d_q must be a positive int, got 0"),
    ("Convolutional d_k=0", lambda: sc.Convolutional(0), ValueError, r"d_k must be a positive int, got 0"),
    ("Convolutional width=True", lambda: sc.Convolutional(4, width=True), ValueError, r"width must be a positive int, got True"),
    ("LearnedQuery d_k=0", lambda: sc.LearnedQuery(0), ValueError, r"d_k must be a positive int, got 0"),
    ("LearnedQuery scaled='yes'", lambda: sc.LearnedQuery(4, scaled="yes"), TypeError, r"scaled must be a bool, got 'yes'"),
    ("Cosine eps=-1", lambda: sc.Cosine(eps=-1), ValueError, r"eps must be > 0, got -1"),
    ("Cosine eps=nan", lambda: sc.Cosine(eps=float("nan")), ValueError, r"eps must be finite, got nan"),
    ("Cosine eps='a'", lambda: sc.Cosine(eps="a"), TypeError, r"eps must be a real number, got 'a'"),
    ("HeadwiseLinear d_in=True", lambda: HeadwiseLinear(True, 3), ValueError, r"d_in must be a positive int, got True"),
    ("HeadwiseLinear num_heads=True", lambda: HeadwiseLinear(2, 3, num_heads=True), ValueError, r"num_heads must be a positive int or None, got True"),
    ("Local window=True", lambda: al.Local(True), ValueError, r"window must be an int >= 0, got True"),
    ("Local d_q=0", lambda: al.Local(1, "predictive", d_q=0), ValueError, r"d_q must be a positive int, got 0"),
    ("Local d_q for monotonic", lambda: al.Local(1, d_q=4), TypeError, r"d_q and d_p are for position='predictive'"),
    ("Local gaussian='no'", lambda: al.Local(1, gaussian="no"), TypeError, r"gaussian must be a bool or None, got 'no'"),
    ("Local float positions", lambda: al.Local(1)(q_(1, 2, 5), positions=torch.tensor([0.0, 1.0])), TypeError, r"positions must be an integer tensor, got dtype torch.float32"),
    ("Local positions of wrong shape", lambda: al.Local(1)(q_(1, 2, 5), positions=torch.tensor([0, 1, 2])), ValueError, r"positions of shape \(3,\) does not broadcast to the query rows .* \(1, 2\)"),
    ("Hard tau=0", lambda: al.Hard(tau=0), ValueError, r"tau must be > 0, got 0"),
    ("Hard tau=nan", lambda: al.Hard(tau=float("nan")), ValueError, r"tau must be finite, got nan"),
    ("Hard straight_through='yes'", lambda: al.Hard(straight_through="yes"), TypeError, r"straight_through must be a bool, got 'yes'"),
    ("Reinforced scale=nan", lambda: al.Reinforced(scale=float("nan")), ValueError, r"scale must be finite, got nan"),
    ("Reinforced bias=inf", lambda: al.Reinforced(bias=float("inf")), ValueError, r"bias must be finite, got inf"),
    ("Softmax temperature=inf", lambda: al.Softmax(float("inf")), ValueError, r"temperature must be finite and > 0, got inf"),
    ("Entmax n_iter=0", lambda: al.Entmax(1.5, n_iter=0), ValueError, r"n_iter must be an int >= 1, got 0"),
    # Mask builders.
    ("causal m=-1", lambda: masks.causal(-1), ValueError, r"m must be an int >= 0, got -1"),
    ("causal n=-3", lambda: masks.causal(2, -3), ValueError, r"n must be an int >= 0, got -3"),
    ("causal m=2.5", lambda: masks.causal(2.5), ValueError, r"m must be an int >= 0, got 2.5"),
    ("window m=-1", lambda: masks.window(-1, 3, 1), ValueError, r"m must be an int >= 0, got -1"),
    ("window n=-1", lambda: masks.window(3, -1, 1), ValueError, r"n must be an int >= 0, got -1"),
    ("window size=-1", lambda: masks.window(3, 3, -1), ValueError, r"size must be an int >= 0, got -1"),
    ("window size=1.5", lambda: masks.window(3, 3, 1.5), ValueError, r"size must be an int >= 0, got 1.5"),
    ("from_lengths n=2.5", lambda: masks.from_lengths(torch.tensor([1, 2]), 2.5), ValueError, r"n must be an int >= 0, got 2.5"),
    ("from_lengths n=True", lambda: masks.from_lengths(torch.tensor([1, 1]), True), ValueError, r"n must be an int >= 0, got True"),
    ("from_lengths n=-1", lambda: masks.from_lengths(torch.tensor([0]), -1), ValueError, r"n must be an int >= 0, got -1"),
    ("from_lengths longer than n", lambda: masks.from_lengths(torch.tensor([4]), 3), ValueError, r"lengths must lie in \[0, n=3\], got \[4\]"),
    ("from_lengths complex", lambda: masks.from_lengths(torch.tensor([1j]), 3), TypeError, r"lengths must be a 1-D integer tensor.*complex"),
    ("combine masks that do not broadcast", lambda: masks.combine(b_(2, 3), b_(4, 5)), ValueError, r"combine: mask 1 of shape \(4, 5\) does not broadcast with the masks before it, of shape \(2, 3\)"),
    ("from_lengths of a string", lambda: masks.from_lengths("abc", 3), TypeError, r"lengths must be a 1-D integer tensor or a list of ints, got 'abc'"),
    ("combine a float mask", lambda: masks.combine(b_(2, 2), torch.ones(2, 2)), TypeError, r"combine: mask 1 must be a boolean tensor or None, got torch.float32"),
    # Multi-head attention and the Transformer blocks.
    ("MHA num_heads=0", lambda: ak.MultiHeadAttention(8, 0), ValueError, r"num_heads must be a positive int, got 0"),
    ("MHA embed_dim=True", lambda: ak.MultiHeadAttention(True, 1), ValueError, r"embed_dim must be a positive int, got True"),
    ("MHA dropout=1", lambda: ak.MultiHeadAttention(8, 2, dropout=1.0), ValueError, r"dropout must be in \[0, 1\), got 1.0"),
    ("MHA dropout='a'", lambda: ak.MultiHeadAttention(8, 2, dropout="a"), TypeError, r"dropout must be a number in \[0, 1\), got 'a'"),
    ("MHA bias='yes'", lambda: ak.MultiHeadAttention(8, 2, bias="yes"), TypeError, r"bias must be a bool, got 'yes'"),
    ("MHA kdim=0", lambda: ak.MultiHeadAttention(8, 2, kdim=0), ValueError, r"kdim must be a positive int, got 0"),
    ("MHA need_weights='y'", lambda: ak.MultiHeadAttention(8, 2)(q_(2, 3, 8), need_weights="y"), TypeError, r"need_weights must be a bool, got 'y'"),
    ("MHA key/value lengths differ", lambda: ak.MultiHeadAttention(8, 2)(q_(2, 3, 8), q_(2, 4, 8), q_(2, 5, 8)), ValueError, r"key of shape \(2, 4, 8\) and value of shape \(2, 5, 8\)"),
    ("MHA query/key batch", lambda: ak.MultiHeadAttention(8, 2)(q_(2, 3, 8), q_(3, 4, 8)), ValueError, r"batch dims of query \(2, 3, 8\) and key \(3, 4, 8\) do not broadcast"),
    ("MHA float64 query, float32 module", lambda: ak.MultiHeadAttention(8, 2)(q_(2, 3, 8, dtype=torch.float64)), TypeError, r"MultiHeadAttention.* has in_proj_weight of dtype torch.float32 but query has torch.float64"),
    ("MHA module on meta", lambda: ak.MultiHeadAttention(8, 2, device="meta")(q_(2, 3, 8)), ValueError, r"MultiHeadAttention.* has in_proj_weight on meta but query is on cpu"),
    ("MHA from_torch of a Linear", lambda: ak.MultiHeadAttention.from_torch(torch.nn.Linear(2, 2)), TypeError, r"expected torch.nn.MultiheadAttention, got Linear"),
    ("encoder layer d_ff=0", lambda: TransformerEncoderLayer(8, 2, d_ff=0), ValueError, r"d_ff must be a positive int, got 0"),
    ("encoder layer d_ff=-1", lambda: TransformerEncoderLayer(8, 2, d_ff=-1), ValueError, r"d_ff must be a positive int, got -1"),
    ("decoder layer d_ff=0", lambda: TransformerDecoderLayer(8, 2, d_ff=0), ValueError, r"d_ff must be a positive int, got 0"),
    ("encoder layer embed_dim=0", lambda: TransformerEncoderLayer(0, 2), ValueError, r"embed_dim must be a positive int, got 0"),
    ("encoder layer dropout=2", lambda: TransformerEncoderLayer(8, 2, dropout=2.0), ValueError, r"dropout must be in \[0, 1\), got 2.0"),
    ("encoder layers=-1", lambda: TransformerEncoder(-1, 8, 2), ValueError, r"layers must be a positive int, got -1"),
    ("encoder layers=0", lambda: TransformerEncoder(0, 8, 2), ValueError, r"layers must be a positive int, got 0"),
    ("encoder layers=1.5", lambda: TransformerEncoder(1.5, 8, 2), ValueError, r"layers must be a positive int, got 1.5"),
    ("encoder unknown argument", lambda: TransformerEncoder(1, 8, 2, d_fff=3), TypeError, r"unexpected keyword argument 'd_fff'"),
    ("decoder memory of wrong width", lambda: TransformerDecoderLayer(8, 2)(q_(2, 3, 8), q_(2, 4, 6)), ValueError, r"key has 6 features \(shape \(2, 4, 6\)\) but this MultiHeadAttention expects 8"),
    # Feature- and query-related mechanisms and models.
    ("ParallelCoAttention d_w=0", lambda: ft.ParallelCoAttention(4, 4, d_w=0), ValueError, r"d_w must be a positive int, got 0"),
    ("ParallelCoAttention d1=0", lambda: ft.ParallelCoAttention(0, 4), ValueError, r"d1 must be a positive int, got 0"),
    ("AlternatingCoAttention d_w=0", lambda: ft.AlternatingCoAttention(4, 4, 0), ValueError, r"d_w must be a positive int, got 0"),
    ("InteractiveCoAttention d1=-1", lambda: ft.InteractiveCoAttention(-1, 4), ValueError, r"d1 must be a positive int, got -1"),
    ("MultiGrainedCoAttention d2=0", lambda: ft.MultiGrainedCoAttention(4, 0), ValueError, r"d2 must be a positive int, got 0"),
    ("ParallelCoAttention (B, 1, N) mask of another batch", lambda: ft.ParallelCoAttention(4, 4)(q_(3, 5, 4), q_(3, 2, 4), b_(2, 1, 5)), ValueError, r"mask1 of shape \(2, 1, 5\) does not fit f1 of shape \(3, 5, 4\)"),
    ("NestedCoAttention d1 != d2", lambda: ft.NestedCoAttention()(q_(2, 5, 4), q_(2, 3, 6)), ValueError, r"NestedCoAttention needs d1 == d2: f1 has 4 features"),
    ("co-attention batch sizes differ", lambda: ft.InteractiveCoAttention(4, 4)(q_(2, 5, 4), q_(3, 3, 4)), ValueError, r"f2 has batch size 3 .* f1 has 2"),
    ("InteractiveCoAttention score1='dot'", lambda: ft.InteractiveCoAttention(4, 4, score1="dot"), TypeError, r"score1 must be an attnkit Score module or None, got str"),
    ("AttentionViaAttention char_score=3", lambda: ft.AttentionViaAttention(3, 4, 5, char_score=3), TypeError, r"char_score must be an attnkit Score module or None, got int"),
    ("HierarchicalAttention sentence_score", lambda: ft.HierarchicalAttention(4, sentence_score=torch.nn.Linear(2, 2)), TypeError, r"sentence_score must be an attnkit Score module or None, got Linear"),
    ("MetaEmbedding score='additive'", lambda: ft.MetaEmbedding([3], 4, score="additive"), TypeError, r"score must be an attnkit Score module or None, got str"),
    ("AttentionViaAttention d_q=0", lambda: ft.AttentionViaAttention(0, 4, 4), ValueError, r"d_q must be a positive int, got 0"),
    ("HierarchicalAttention d=0", lambda: ft.HierarchicalAttention(0), ValueError, r"d must be a positive int, got 0"),
    ("HierarchicalAttention sentence_encoder", lambda: ft.HierarchicalAttention(4, sentence_encoder="gru"), TypeError, r"sentence_encoder must be an nn.Module or None, got 'gru'"),
    ("MetaEmbedding dims=[0]", lambda: ft.MetaEmbedding([0], 4), ValueError, r"dims\[0\] must be a positive int, got 0"),
    ("MetaEmbedding d_t=0", lambda: ft.MetaEmbedding([3], 0), ValueError, r"d_t must be a positive int, got 0"),
    ("MetaEmbedding dims=3", lambda: ft.MetaEmbedding(3, 4), TypeError, r"dims must be a list of positive ints, got 3"),
    ("RotatoryAttention d_l=0", lambda: ft.RotatoryAttention(0, 4, 4), ValueError, r"d_l must be a positive int, got 0"),
    ("RotatoryAttention hops=True", lambda: ft.RotatoryAttention(4, 4, 4, hops=True), ValueError, r"hops must be a positive int, got True"),
    ("RotatoryAttention share_weights=1", lambda: ft.RotatoryAttention(4, 4, 4, share_weights=1), TypeError, r"share_weights must be a bool, got 1"),
    ("CapsuleAttention n_classes=0", lambda: qr.CapsuleAttention(4, 0), ValueError, r"n_classes must be a positive int, got 0"),
    ("CapsuleAttention d_f=0", lambda: qr.CapsuleAttention(0, 3), ValueError, r"d_f must be a positive int, got 0"),
    ("CapsuleAttention float mask", lambda: qr.CapsuleAttention(4, 3)(q_(2, 5, 4), torch.ones(2, 5)), TypeError, r"mask must be boolean \(True = a real feature\), got dtype torch.float32"),
    ("ImportanceMatrixAttention n_outputs=0", lambda: qr.ImportanceMatrixAttention(4, 4, 0), ValueError, r"n_outputs must be a positive int, got 0"),
    ("LabelWiseAttention n_labels=0", lambda: qr.LabelWiseAttention(4, 4, 0), ValueError, r"n_labels must be a positive int, got 0"),
    ("MultiHop hops=True", lambda: qr.MultiHop(4, 4, 4, hops=True), ValueError, r"hops must be a positive int, got True"),
    ("MultiHop d_q=0", lambda: qr.MultiHop(0, 4, 4), ValueError, r"d_q must be a positive int, got 0"),
    ("MultiHop query with a length dim", lambda: qr.MultiHop(3, 4, 4)(q_(2, 1, 3), q_(2, 5, 4)), ValueError, r"query must be \(B, d\), got shape \(2, 1, 3\)"),
    ("SelfAttention d_f=0", lambda: qr.SelfAttention(0), ValueError, r"d_f must be a positive int, got 0"),
    ("SelfAttention 2-D mask", lambda: qr.SelfAttention(4)(q_(3, 3, 4), b_(3, 3)), ValueError, r"mask of shape \(3, 3\) for f of shape \(3, 3, 4\): pass a 3-D mask"),
    ("SelfAttention attention='dot'", lambda: qr.SelfAttention(4, attention="dot"), TypeError, r"attention must be an attention module or None, got 'dot'"),
    ("QueryTagged of a string", lambda: qr.QueryTagged("x", "basic"), TypeError, r"module must be an nn.Module, got str"),
    ("frobenius_penalty of a vector", lambda: qr.frobenius_penalty(torch.ones(3)), ValueError, r"weights must have at least 2 dims"),
    ("Seq2SeqAttention vocab_in=0", lambda: Seq2SeqAttention(0, 3, 4, ak.Attention()), ValueError, r"vocab_in must be a positive int, got 0"),
    ("Seq2SeqAttention attention='dot'", lambda: Seq2SeqAttention(3, 3, 4, "dot"), TypeError, r"attention must be an attnkit Attention, got str"),
    # Forward calls of parts used on their own.
    ("score: q of rank 1", lambda: sc.Additive(4, 4, 4)(q_(4), q_(2, 5, 4)), ValueError, r"q must have at least 2 dims .*\(4,\)"),
    ("score: integer q", lambda: sc.Additive(4, 4, 4)(torch.ones(2, 3, 4, dtype=torch.long), q_(2, 5, 4)), TypeError, r"q must be a floating-point tensor, got dtype torch.int64"),
    ("score: k not a tensor", lambda: sc.Additive(4, 4, 4)(q_(2, 3, 4), [1, 2]), TypeError, r"k must be a torch.Tensor, got list"),
    ("score: float64 inputs, float32 parameters", lambda: sc.General(4, 4)(q_(2, 3, 4, dtype=torch.float64), q_(2, 5, 4, dtype=torch.float64)), TypeError, r"the score \(General\) has W.weight of dtype torch.float32 but k has torch.float64"),
    ("score: q and k of two dtypes", lambda: sc.Dot()(q_(2, 3, 4), q_(2, 5, 4, dtype=torch.float64)), TypeError, r"k has dtype torch.float64 but q has torch.float32"),
    ("convolutional score: k of rank 1", lambda: sc.Convolutional(4)(None, q_(4)), ValueError, r"k must have at least 2 dims"),
    ("alignment: scores of rank 1", lambda: al.Local(1)(q_(5)), ValueError, r"scores must have at least 2 dims"),
    ("alignment: scores not a tensor", lambda: al.Hard()([1.0, 2.0]), TypeError, r"scores must be a torch.Tensor, got list"),
    ("alignment: float mask", lambda: al.Local(1)(q_(1, 2, 5), torch.ones(1, 2, 5)), TypeError, r"mask must be boolean .*torch.float32"),
    ("alignment: mask of wrong shape", lambda: al.Hard()(q_(1, 2, 5), b_(1, 2, 4)), ValueError, r"mask of shape \(1, 2, 4\) does not broadcast to the scores' shape \(1, 2, 5\)"),
    ("uniform: float mask", lambda: al.Uniform()(q_(1, 2, 5), torch.ones(1, 2, 5)), TypeError, r"mask must be boolean"),
    ("reinforced: mask of another batch", lambda: al.Reinforced()(q_(1, 2, 5), b_(3, 2, 5)), ValueError, r"mask of shape \(3, 2, 5\) does not broadcast"),
    ("local: negative positions", lambda: al.Local(1)(q_(1, 2, 5), positions=-3), ValueError, r"positions must be >= 0, got min -3"),
    ("local predictive: query of wrong width", lambda: al.Local(1, "predictive", d_q=4)(q_(1, 2, 5), query=q_(1, 2, 3)), ValueError, r"query must be \(…, M, d_q\) with d_q = 4 \(eq. 28\), got \(1, 2, 3\)"),
    ("HeadwiseLinear: input of wrong width", lambda: HeadwiseLinear(4, 3)(q_(2, 5)), ValueError, r"input has 5 features \(shape \(2, 5\)\) but this layer takes d_in = 4"),
    ("encoder: mask of wrong length", lambda: TransformerEncoderLayer(8, 2)(q_(2, 3, 8), b_(2, 3, 4)), ValueError, r"mask of shape \(2, 3, 4\) does not broadcast to the scores' shape \(2, 3, 3\)"),
    ("decoder: memory_mask of wrong length", lambda: TransformerDecoderLayer(8, 2)(q_(2, 3, 8), q_(2, 4, 8), memory_mask=b_(2, 1, 5)), ValueError, r"mask of shape \(2, 1, 5\) does not broadcast to the scores' shape \(2, 3, 4\)"),
    ("MHA: bias of wrong shape", lambda: ak.MultiHeadAttention(8, 2)(q_(2, 3, 8), bias=torch.zeros(2, 3, 4)), ValueError, r"bias of shape \(2, 3, 4\) does not broadcast to \(2, 3, 3\)"),
    ("seq2seq: float src", lambda: _s2s()(q_(2, 5), torch.randint(0, 12, (2, 3))), TypeError, r"src must be an integer tensor of token ids \(B, L\), got torch.float32"),
    ("seq2seq: tgt_in of another batch", lambda: _s2s()(torch.randint(0, 10, (2, 5)), torch.randint(0, 12, (3, 3))), ValueError, r"tgt_in of shape \(3, 3\) must have src's batch size 2"),
    ("seq2seq: src_mask of wrong length", lambda: _s2s()(torch.randint(0, 10, (2, 5)), torch.randint(0, 12, (2, 3)), b_(2, 4)), ValueError, r"src_mask of shape \(2, 4\) does not fit src of shape \(2, 5\)"),
    ("seq2seq: token id out of the vocabulary", lambda: _s2s()(torch.full((2, 5), 10), torch.randint(0, 12, (2, 3))), ValueError, r"src holds ids outside \[0, 10\): min 10, max 10"),
    ("seq2seq: src of rank 1", lambda: _s2s()(torch.randint(0, 10, (5,)), torch.randint(0, 12, (3,))), ValueError, r"src must be \(B, L\) token ids, got shape \(5,\)"),
    ("seq2seq: generate length -1", lambda: _s2s().generate(torch.randint(0, 10, (2, 5)), -1, 1), ValueError, r"length must be a positive int, got -1"),
    ("seq2seq: generate bos out of the vocabulary", lambda: _s2s().generate(torch.randint(0, 10, (2, 5)), 3, 99), ValueError, r"bos must be a token id in \[0, 12\), got 99"),
    ("capsule_loss: class out of range", lambda: qr.capsule_loss(qr.CapsuleAttention(4, 3)(q_(2, 5, 4)), q_(2, 5, 4), torch.tensor([0, 5])), ValueError, r"target holds classes outside \[0, 3\): \[0, 5\]"),
    ("capsule_loss: float target", lambda: qr.capsule_loss(qr.CapsuleAttention(4, 3)(q_(2, 5, 4)), q_(2, 5, 4), torch.tensor([0.0, 1.0])), TypeError, r"target must be an integer tensor of class indices"),
    ("capsule: float64 features, float32 module", lambda: qr.CapsuleAttention(4, 3)(q_(2, 5, 4, dtype=torch.float64)), TypeError, r"CapsuleAttention \(CapsuleAttention\) has queries of dtype torch.float32 but features has torch.float64"),
    ("co-attention: float64 features, float32 module", lambda: ft.ParallelCoAttention(4, 4)(q_(2, 5, 4, dtype=torch.float64), q_(2, 3, 4, dtype=torch.float64)), TypeError, r"ParallelCoAttention\) has W_A of dtype torch.float32 but f1 has torch.float64"),
    ("multi-hop: module on meta", lambda: qr.MultiHop(3, 4, 4, device="meta")(q_(2, 3), q_(2, 5, 4)), ValueError, r"MultiHop\) has transforms.0.weight on meta but query is on cpu"),
    ("rotatory: score factory not callable", lambda: ft.RotatoryAttention(4, 4, 4, score=3), TypeError, r"score must be a factory score\(d_q, d_k\) -> Score or None, got 3"),
    ("hierarchical: (B, S) mask", lambda: ft.HierarchicalAttention(4)(q_(2, 3, 4, 4), b_(2, 3)), ValueError, r"word_mask of shape \(2, 3\) does not fit words of shape \(2, 3, 4, 4\)"),
    ("mechanisms: unknown argument", lambda: ak.mechanisms.build("capsule", d_f=4, n_classes=3, dd=1), TypeError, r"mechanism 'capsule' got an unexpected argument 'dd'"),
    ("mechanisms: unknown name", lambda: ak.mechanisms.example("caps"), ValueError, r"unknown mechanism 'caps'; did you mean 'capsule'\?"),
]  # fmt: skip


def _s2s():
    torch.manual_seed(0)
    return Seq2SeqAttention(10, 12, 8, ak.Attention(sc.Additive(8, 16, 8)))


def _heads_mha(score):
    return ak.MultiHeadAttention(4, 2, score=score)


# Wrong attention calls, each through the function, the module and multi-head attention. The
# multi-head module names its own arguments (query, key, value) and checks its parts.
THREE_WAYS = [
    (
        "float64 bias with float32 inputs",
        TypeError,
        [
            (lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), bias=torch.zeros(2, 3, 6, dtype=torch.float64)), r"bias has dtype torch.float64 but q has torch.float32"),
            (lambda: ak.Attention()(q_(2, 3, 4), q_(2, 6, 4), bias=torch.zeros(2, 3, 6, dtype=torch.float64)), r"bias has dtype torch.float64 but q has torch.float32"),
            (lambda: ak.MultiHeadAttention(4, 2)(q_(2, 3, 4), bias=torch.zeros(2, 3, 3, dtype=torch.float64)), r"bias has dtype torch.float64 but query has torch.float32"),
        ],
    ),
    (
        "float64 bias on the chunked kernel",
        TypeError,
        [
            (lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), align="sparsemax", chunk_size=2, bias=torch.zeros(3, 6, dtype=torch.float64)), r"bias has dtype torch.float64"),
            (lambda: ak.Attention(align="sparsemax")(q_(2, 3, 4), q_(2, 6, 4), chunk_size=2, bias=torch.zeros(3, 6, dtype=torch.float64)), r"bias has dtype torch.float64"),
        ],
    ),
    (
        "score on meta with CPU inputs",
        ValueError,
        [
            (lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), score=sc.General(4, 4, device="meta")), r"the score \(General\) has W.weight on meta but q is on cpu"),
            (lambda: ak.Attention(sc.General(4, 4, device="meta"))(q_(2, 3, 4), q_(2, 6, 4)), r"the score \(General\) has W.weight on meta but q is on cpu"),
            (lambda: _heads_mha(sc.General(2, 2, num_heads=2, device="meta"))(q_(2, 3, 4)), r"has (attention\.)?score.W.weight on meta but query is on cpu"),
        ],
    ),
    (
        "float64 score with float32 inputs",
        TypeError,
        [
            (lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), score=sc.Additive(4, 4, 5, dtype=torch.float64)), r"the score \(Additive\) has W1.weight of dtype torch.float64 but q has torch.float32"),
            (lambda: ak.Attention(sc.Additive(4, 4, 5, dtype=torch.float64))(q_(2, 3, 4), q_(2, 6, 4)), r"the score \(Additive\) has W1.weight of dtype torch.float64"),
            (lambda: _heads_mha(sc.Additive(2, 2, 5, num_heads=2, dtype=torch.float64))(q_(2, 3, 4)), r"has (attention\.)?score.W1.weight of dtype torch.float64 but query has torch.float32"),
        ],
    ),
    (
        "inputs of two dtypes",
        TypeError,
        [
            (lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4, dtype=torch.float64)), r"k has dtype torch.float64 but q has torch.float32"),
            (lambda: ak.Attention()(q_(2, 3, 4), q_(2, 6, 4), q_(2, 6, 4, dtype=torch.float64)), r"v has dtype torch.float64 but q has torch.float32"),
            (lambda: ak.MultiHeadAttention(4, 2)(q_(2, 3, 4), q_(2, 6, 4, dtype=torch.float64)), r"key has dtype torch.float64 but query has torch.float32"),
        ],
    ),
    (
        "inputs on two devices",
        ValueError,
        [
            (lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4).to("meta")), r"k is on meta but q is on cpu"),
            (lambda: ak.Attention()(q_(2, 3, 4), q_(2, 6, 4), q_(2, 6, 4).to("meta")), r"v is on meta but q is on cpu"),
            (lambda: ak.MultiHeadAttention(4, 2)(q_(2, 3, 4), q_(2, 6, 4).to("meta")), r"key is on meta but query is on cpu"),
        ],
    ),
    (
        "a per-head score given a batch without a head dim",
        ValueError,
        [
            (lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), score=sc.General(4, 4, num_heads=2)), r"General score was built with num_heads=2: q must be \(B, …, H, L, d\).*got shape \(2, 3, 4\)"),
            (lambda: ak.Attention(sc.Additive(4, 4, 5, num_heads=2))(q_(2, 3, 4), q_(2, 6, 4)), r"Additive score was built with num_heads=2: q must be .*\(2, 3, 4\)"),
            (lambda: _heads_mha(sc.General(2, 2, num_heads=3))(q_(2, 3, 4)), r"General score was built with num_heads=3: q must be .*\(2, 2, 3, 2\)"),
        ],
    ),
    (
        "feature size 0",
        ValueError,
        [
            (lambda: ak.attention(q_(2, 3, 0), q_(2, 6, 0)), r"q has no features \(size 0 in the last dim, shape \(2, 3, 0\)\)"),
            (lambda: ak.Attention()(q_(2, 3, 4), q_(2, 6, 4), q_(2, 6, 0)), r"v has no features .*\(2, 6, 0\)"),
            (lambda: ak.MultiHeadAttention(4, 2)(q_(2, 3, 0)), r"query has 0 features \(shape \(2, 3, 0\)\) but this MultiHeadAttention expects 4"),
        ],
    ),
    (
        "complex q",
        TypeError,
        [
            (lambda: ak.attention(torch.randn(2, 3, 4, dtype=torch.complex64), q_(2, 6, 4)), r"q must be a floating-point tensor, got dtype torch.complex64"),
            (lambda: ak.Attention()(torch.randn(2, 3, 4, dtype=torch.complex64), torch.randn(2, 6, 4, dtype=torch.complex64)), r"^q must be a floating-point tensor, got dtype torch.complex64"),
            (lambda: ak.MultiHeadAttention(4, 2)(torch.randn(2, 3, 4, dtype=torch.complex64)), r"query must be a floating-point tensor, got dtype torch.complex64"),
        ],
    ),
    (
        "mask of float dtype",
        TypeError,
        [
            (lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), mask=torch.ones(2, 3, 6)), r"mask must be boolean .*torch.float32"),
            (lambda: ak.Attention()(q_(2, 3, 4), q_(2, 6, 4), mask=torch.ones(2, 1, 6)), r"mask must be boolean .*torch.float32"),
            (lambda: ak.MultiHeadAttention(4, 2)(q_(2, 3, 4), mask=torch.ones(2, 1, 3)), r"mask must be boolean .*torch.float32"),
        ],
    ),
    (
        "mask of another batch",
        ValueError,
        [
            (lambda: ak.attention(q_(3, 3, 4), q_(3, 6, 4), mask=b_(2, 1, 6)), r"mask of shape \(2, 1, 6\) does not broadcast to the scores' shape \(3, 3, 6\)"),
            (lambda: ak.Attention()(q_(3, 3, 4), q_(3, 6, 4), mask=b_(2, 1, 6)), r"mask of shape \(2, 1, 6\) does not broadcast"),
            (lambda: ak.MultiHeadAttention(4, 2)(q_(3, 3, 4), mask=b_(2, 1, 3)), r"mask of shape \(2, 1, 3\) does not broadcast to the scores' shape \(3, 3, 3\)"),
        ],
    ),
    (
        "chunk_size=True",
        ValueError,
        [
            (lambda: ak.attention(q_(2, 3, 4), q_(2, 6, 4), align="sparsemax", chunk_size=True), r"chunk_size must be a positive int, got True"),
            (lambda: ak.Attention(align="sparsemax")(q_(2, 3, 4), q_(2, 6, 4), chunk_size=True), r"chunk_size must be a positive int, got True"),
        ],
    ),
]  # fmt: skip

THREE_WAY_CALLS = [
    (f"{name} [{via}]", call, error, message)
    for name, error, calls in THREE_WAYS
    for via, (call, message) in zip(
        ("attention", "Attention", "MultiHeadAttention"), calls, strict=False
    )
]


@pytest.mark.parametrize(
    ("name", "call", "error", "message"), THREE_WAY_CALLS, ids=[c[0] for c in THREE_WAY_CALLS]
)
def test_bad_attention_call_every_way(name, call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize(
    ("name", "call", "error", "message"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS]
)
def test_bad_call(name, call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_table_is_big_enough():
    assert len(BAD_CALLS) + len(THREE_WAY_CALLS) >= 150


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: ak.attention(q_(1, 2, 4), q_(1, 3, 4), need_weights="yes"),
            TypeError,
            r"need_weights must be a bool, got 'yes'",
        ),
        (
            lambda: ak.Attention(dropout="a"),
            TypeError,
            r"dropout must be a number in \[0, 1\), got 'a'",
        ),
        (
            lambda: ak.attention(q_(1, 2, 4), q_(1, 3, 4), dropout=True),
            TypeError,
            r"dropout must be a number",
        ),
    ],
)
def test_flags_of_the_wrong_type(call, error, match):
    with pytest.raises(error, match=match):
        call()


HELPER_CALLS = [
    ("boolean_mask: float", lambda: checks.boolean_mask(torch.full((2, 3), 0.5), "mask", (2, 3)), TypeError, r"mask must be boolean \(True = may attend\), got dtype torch.float32; convert a 0/1 tensor with mask.bool\(\); additive float biases are not masks"),
    ("boolean_mask: other meaning", lambda: checks.boolean_mask(torch.ones(3), "keep", (3,), meaning="True = kept"), TypeError, r"keep must be boolean \(True = kept\), got dtype torch.float32; convert a 0/1 tensor with keep.bool\(\)$"),
    ("boolean_mask: list", lambda: checks.boolean_mask([True], "mask", (1,)), TypeError, r"mask must be a boolean torch.Tensor, got list"),
    ("boolean_mask: beyond the target", lambda: checks.boolean_mask(b_(4, 2, 3), "mask", (2, 3)), ValueError, r"mask of shape \(4, 2, 3\) does not broadcast to \(2, 3\)"),
    ("floating: integer", lambda: checks.floating(torch.ones(3, dtype=torch.long), "w", "(…, N)"), TypeError, r"w must be a floating-point tensor \(…, N\), got dtype torch.int64"),
    ("floating: too few dims", lambda: checks.floating(torch.tensor(1.0), "w", "(…, N)"), ValueError, r"w must be \(…, N\), got shape \(\)"),
    ("same_shape", lambda: checks.same_shape(("a", q_(2, 3)), ("b", q_(3, 2))), ValueError, r"b has shape \(3, 2\) but a has \(2, 3\)"),
    ("nonnegative", lambda: checks.nonnegative(torch.tensor([[0.5, 0.0], [0.2, -1e-3]]), "w"), ValueError, r"w must be non-negative \(attention weights\), got -0.001.* at index \(1, 1\)"),
    ("nonnegative: NaN", lambda: checks.nonnegative(torch.tensor([0.5, math.nan]), "w"), ValueError, r"got nan at index \(1,\)"),
    ("distributions: row sums 0.9", lambda: checks.distributions(torch.tensor([[0.5, 0.5], [0.4, 0.5]]), "p"), ValueError, r"p must hold probability distributions.*row \(1,\) sums to 0.9"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in HELPER_CALLS], ids=[c[0] for c in HELPER_CALLS]
)
def test_shared_checks(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_distributions_accept_empty_rows_and_rounding():
    p = torch.tensor([[0.0, 0.0], [0.5, 0.5 + 1e-4]])
    assert checks.distributions(p, "p") is p
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        w = x.to(dtype).softmax(-1)
        assert checks.distributions(w, "w") is w


def test_a_half_mask_is_not_a_mask_anywhere():
    q = q_(2, 3, 4)
    half = torch.full((2, 3, 3), 0.5)
    with pytest.raises(TypeError, match=r"mask must be boolean.*bias=.*mask.bool\(\)"):
        ak.attention(q, q, mask=half)
    with pytest.raises(TypeError, match=r"mask must be boolean.*bias=.*mask.bool\(\)"):
        ak.MultiHeadAttention(4, 2)(q, mask=half)


def _buildable_by_name(name):
    try:
        checks.resolve_alignment(name)
    except TypeError:
        return False
    return True


@pytest.mark.parametrize("name", [a for a in ak.alignments.available() if _buildable_by_name(a)])
def test_a_part_resolved_by_name_is_built_on_the_device_and_dtype_given(name):
    part = checks.resolve_alignment(name, device="meta", dtype=torch.float64)
    tensors = [*part.parameters(), *part.buffers()]
    assert all(t.device.type == "meta" for t in tensors)
    assert all(t.dtype == torch.float64 for t in tensors if t.is_floating_point())
    module = ak.scores.ScaledDot()
    assert checks.resolve_score(module, dtype=torch.float64) is module  # modules are kept
