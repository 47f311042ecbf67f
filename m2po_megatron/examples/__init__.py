"""Example rollout functions, written only with the plug-in surface `m2po_megatron.api` (docs/agents.md).

- `calculator`: a multi-turn, tool-using episode: the policy may call a calculator
  (`<call name="calc">EXPRESSION</call>`), the environment answers (`<result>VALUE</result>`), the policy
  answers in `\\boxed{}`. `make demo-agent` trains the tiny CPU model on it (docs/demo.md).
"""
