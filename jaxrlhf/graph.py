"""`python -m jaxrlhf.graph --config=configs/ppo_tiny.py --out=dfg.png`: draw an algorithm's graph.

Boxes are MFCs coloured by call kind, ellipses are dataset keys, solid arrows carry batch keys
(labelled), dashed arrows are parameter-version dependencies into the next step. Needs no
devices: it only builds and validates the graph.
"""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from jaxrlhf import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config", lock_config=True)
_OUT = flags.DEFINE_string("out", "dfg.png", "output picture (.png, .pdf or .svg)")

_COLORS = {"generate": "#8ecae6", "inference": "#b7e4c7", "train_step": "#ffb4a2"}


def draw(graph, path: str) -> None:
    """Writes the picture of a DataflowGraph to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    g = nx.DiGraph()
    for name in graph.order:
        g.add_node(name)
    for key in graph.dataset_keys:
        g.add_node(key)
    for mfc in graph.mfcs:
        for key in mfc.inputs:
            source = graph.producer(key) or key
            label = "" if source == key else key
            if g.has_edge(source, mfc.name):
                label = ", ".join(filter(None, [g.edges[source, mfc.name]["label"], label]))
            g.add_edge(source, mfc.name, label=label)
    for depth, layer in enumerate(nx.topological_generations(g)):
        for node in layer:
            g.nodes[node]["layer"] = depth
    pos = nx.multipartite_layout(g, subset_key="layer", align="horizontal", scale=3)
    pos = {n: (x, -y) for n, (x, y) in pos.items()}
    fig, ax = plt.subplots(figsize=(12, 8))
    mfc_names = list(graph.order)
    nx.draw_networkx_nodes(g, pos, nodelist=list(graph.dataset_keys), node_shape="o",
                           node_color="#eeeeee", node_size=1800, ax=ax)
    nx.draw_networkx_nodes(g, pos, nodelist=mfc_names, node_shape="s", node_size=3200,
                           node_color=[_COLORS[graph.mfc(n).call.value] for n in mfc_names], ax=ax)
    labels = {n: f"{n}\n{graph.mfc(n).role.value}.{graph.mfc(n).call.value}" for n in mfc_names}
    labels.update({k: k for k in graph.dataset_keys})
    nx.draw_networkx_labels(g, pos, labels, font_size=7, ax=ax)
    nx.draw_networkx_edges(g, pos, arrows=True, node_size=3200, ax=ax)
    nx.draw_networkx_edge_labels(g, pos, nx.get_edge_attributes(g, "label"), font_size=6, ax=ax)
    versions = graph.parameter_version_edges()
    nx.draw_networkx_edges(g, pos, edgelist=versions, style="dashed", edge_color="gray",
                           connectionstyle="arc3,rad=0.3", arrows=True, node_size=3200, ax=ax)
    ax.set_title("dataflow graph (dashed: parameter version, into the next step)")
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    from jaxrlhf.spec import run_spec

    spec = run_spec(_CONFIG.value)
    algorithm, graph = spec.algorithm, spec.graph
    draw(graph, _OUT.value)
    print(f"{algorithm.name}: {len(graph.mfcs)} MFCs, dataset keys {list(graph.dataset_keys)} "
          f"-> {_OUT.value}")


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    cli.run(main)
