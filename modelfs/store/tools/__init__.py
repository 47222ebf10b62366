"""The files a model directory shows and other tools' layouts: model files, merged views,
tool views and `modelfs link`."""
