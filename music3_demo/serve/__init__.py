"""The serving layer, with no Gradio in it: loaded pipelines per device (holder), the line of songs (scheduler), a
song as a job (runner), the song store, measured speeds and the ZeroGPU relay."""
