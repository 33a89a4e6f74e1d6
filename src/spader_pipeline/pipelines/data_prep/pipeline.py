from kedro.pipeline import Pipeline, node, pipeline

from . import nodes


def create_pipeline(**kwargs) -> Pipeline:
    return pipeline(
        [
            node(nodes.read_wiki_articles, "params:data_prep.wiki", "wiki_articles", name="read_wiki_articles"),
            node(nodes.build_corpus, ["wiki_articles", "params:data_prep.corpus"], "corpus", name="build_corpus"),
            node(
                nodes.build_embedded_questions,
                ["wiki_articles", "params:data_prep.embedded_qa"],
                "embedded_qa_rows",
                name="build_embedded_questions",
            ),
            node(nodes.read_benchmarks, "params:data_prep.benchmarks", "benchmark_qa_rows", name="read_benchmarks"),
            node(
                nodes.validate_questions,
                ["embedded_qa_rows", "benchmark_qa_rows", "params:data_prep.validation"],
                ["qa_validated", "qa_quarantine", "data_prep_metrics"],
                name="validate_questions",
            ),
            node(
                nodes.write_quality_report,
                ["data_prep_metrics", "qa_quarantine"],
                "data_quality_report",
                name="write_quality_report",
            ),
            node(
                nodes.check_quality_gate,
                ["qa_validated", "data_prep_metrics", "data_quality_report", "params:data_prep.validation"],
                "qa_unified",
                name="check_quality_gate",
            ),
            node(nodes.write_eval_sets, ["qa_unified", "params:data_prep.outputs"], "eval_sets", name="write_eval_sets"),
            node(
                nodes.build_verl_datasets,
                ["qa_unified", "params:prompt", "params:data_prep.verl"],
                ["verl_train", "verl_validation"],
                name="build_verl_datasets",
            ),
        ],
        tags="data_prep",
    )
