"""Host-side data: tokenizers, dataset files, the built-in task, reward functions.

Modules: `tokenizer`, `datasets`, `tasks`, `rewards`. Import them directly; this
package deliberately re-exports nothing so that reward worker processes, which import
`jaxrlhf.data.rewards`, do not also load pyarrow and tokenizers.
"""
