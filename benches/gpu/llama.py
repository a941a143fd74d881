"""A Llama decoder layer in plain PyTorch (RMSNorm, GQA attention through SDPA, SwiGLU MLP),
shared by the GPU scripts: the shapes the trace generator models."""
import torch
import torch.nn.functional as F


class Layer(torch.nn.Module):
    def __init__(self, hidden, heads, kv_heads, ffn):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        hd = self.head_dim
        self.n1 = torch.nn.RMSNorm(hidden)
        self.q = torch.nn.Linear(hidden, heads * hd, bias=False)
        self.kv = torch.nn.Linear(hidden, 2 * kv_heads * hd, bias=False)
        self.o = torch.nn.Linear(heads * hd, hidden, bias=False)
        self.n2 = torch.nn.RMSNorm(hidden)
        self.gate_up = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        heads, kv, hd = self.heads, self.kv_heads, self.head_dim
        h = self.n1(x)
        q = self.q(h).view(b, s, heads, hd).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, kv, hd).unbind(2)
        k = k.transpose(1, 2).repeat_interleave(heads // kv, dim=1)
        v = v.transpose(1, 2).repeat_interleave(heads // kv, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, heads * hd))
        g, u = self.gate_up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)
