// The job page's live charts (Chart.js): fed by the job's server-sent events, which send the
// history once and then only new events (the browser resumes from its Last-Event-ID).
(function () {
  const jobId = document.currentScript.dataset.jobId;
  const config = JSON.parse(document.getElementById("chart-config").textContent);
  const colors = ["#1c7ed6", "#e8590c", "#2b8a3e", "#862e9c", "#c92a2a", "#5c940d"];

  function lineChart(canvas, title) {
    return new Chart(canvas, {
      type: "line",
      data: { datasets: [] },
      options: {
        animation: false, maintainAspectRatio: false, parsing: false,
        plugins: { title: { display: true, text: title } },
        scales: {
          x: { type: "linear", title: { display: true, text: "step" } },
          y: { ticks: { callback: (v) => +Number(v).toPrecision(3) } },
        },
        elements: { point: { radius: 0 } },
      },
    });
  }

  // One chart per panel; a metric's dataset is made the first time a step carries it.
  const panels = config.panels.map(([title, names], i) => ({
    names, chart: lineChart(document.getElementById("chart-" + i), title), sets: {},
  }));
  const timeChart = new Chart(document.getElementById("chart-time"), {
    type: "bar",
    data: { labels: [], datasets: config.step_time_parts.map((name, i) => ({
      label: name, data: [], backgroundColor: colors[i % colors.length] })) },
    options: {
      animation: false, maintainAspectRatio: false,
      plugins: { title: { display: true, text: "step time split (s)" } },
      scales: { x: { stacked: true }, y: { stacked: true } },
    },
  });

  function addStep(ev) {
    for (const panel of panels) {
      for (const name of panel.names) {
        if (!(name in ev.metrics)) continue;
        if (!panel.sets[name]) {
          const color = colors[Object.keys(panel.sets).length % colors.length];
          panel.sets[name] = { label: name, data: [], borderColor: color, backgroundColor: color };
          panel.chart.data.datasets.push(panel.sets[name]);
        }
        panel.sets[name].data.push({ x: ev.step, y: ev.metrics[name] });
      }
    }
    timeChart.data.labels.push(ev.step);
    config.step_time_parts.forEach((name, i) => {
      timeChart.data.datasets[i].data.push(ev.metrics[name] ?? 0);
    });
    document.getElementById("job-step").textContent = ev.step;
    if (ev.metrics.env_errors) {  // the first reason: the step's env_error_reason
      envErrors += ev.metrics.env_errors;
      const shown = document.getElementById("job-env-errors");
      shown.textContent = envErrors;
      shown.className = "state FAILED";
      const first = document.getElementById("job-env-error-first");
      if (ev.env_error_reason && first.hidden) {
        first.textContent = `first env error (step ${ev.step}): ${ev.env_error_reason}`;
        first.hidden = false;
      }
    }
    if (ev.metrics.reward_mean != null) {  // null: not a finite number (NaN)
      document.getElementById("job-reward").textContent = ev.metrics.reward_mean.toFixed(3);
    }
  }

  let envErrors = 0;  // episodes of every step so far that ended in an env error
  function showFirstEnvError(text) {  // the trainer's line: "env 'x': 2 of 8 episodes failed"
    const first = document.getElementById("job-env-error-first");
    if (!first.hidden || !/^env '[^']*': \d+ of \d+ episodes failed/.test(text)) return;
    first.textContent = "first env error: " + text;
    first.hidden = false;
  }

  function addLine(text) {
    const item = document.createElement("li");
    item.textContent = text;
    document.getElementById("log").appendChild(item);
  }

  let pending = false;  // redraw at most once a frame, however many events arrive
  function redraw() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      panels.forEach((p) => p.chart.update("none"));
      timeChart.update("none");
    });
  }

  let allocations = 0;  // ALLOCATING events seen: one per attempt (the stream starts at the first)
  const source = new EventSource("/jobs/" + encodeURIComponent(jobId) + "/events");
  source.addEventListener("job", (message) => {
    const ev = JSON.parse(message.data);
    window.jobEventsSeen = ev.seq;
    if (ev.kind === "step") {
      addStep(ev);
      redraw();
    } else if (ev.kind === "state") {
      const state = document.getElementById("job-state");
      state.textContent = ev.state;
      state.className = "state " + ev.state;
      document.getElementById("job-reason").textContent = ev.reason;
      if (ev.state === "ALLOCATING") {  // the scheduler starts a new attempt with each lease
        allocations += 1;
        const attempt = document.getElementById("job-attempt");
        attempt.textContent = Math.max(Number(attempt.dataset.rendered), allocations);
      }
      addLine(ev.state + (ev.reason ? " — " + ev.reason : ""));
    } else if (ev.kind === "log") {
      showFirstEnvError(ev.message);
      addLine(ev.message);
    }
  });
  source.addEventListener("end", () => {
    source.close();
    const form = document.getElementById("cancel-form");
    if (form) form.remove();
  });
})();
