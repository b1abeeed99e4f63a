// Command bench measures the outbox side by side with plain SQL and with
// its peers, River and Watermill, on one PostgreSQL server (and SQLite):
//
//	cd bench && go run . -duration 20s
//
// It runs four scenarios, each in a fresh PostgreSQL schema of its own
// (and a fresh SQLite file), and prints a table per scenario as it goes:
//
//   - write: transactions per second of a business insert, plain, with the
//     outbox rows written by hand, and through GORM with the plugin;
//   - dispatch: events per second drained from a backlog by the outbox
//     dispatcher, by a plain-SQL claim/settle loop, by River and by
//     Watermill's SQL forwarder;
//   - latency: commit-to-publish percentiles at a steady 1,000 events/s,
//     woken by NOTIFY and by polling only;
//   - backlog: dispatch throughput from a small and from a big backlog.
//
// It ends with one "name value unit" line per figure. The README beside
// this file says what each figure means.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// config is everything a run depends on; flags fill it in main, and the
// smoke test builds one with smokeConfig.
type config struct {
	dsn          string        // PostgreSQL server (a key=value DSN)
	duration     time.Duration // per timed scenario (write, latency)
	writeTime    time.Duration // per write measurement; duration unless smoke
	backlog      int           // dispatch backlog
	smallBacklog int           // backlog scenario, small size
	bigBacklog   int           // backlog scenario, big size
	aggregates   int           // distinct aggregates in loaded backlogs
	rate         int           // latency scenario, events per second
	writeClients []int         // write scenario client counts
	dispatchers  []int         // dispatch scenario dispatcher counts
	batchSizes   []int         // dispatch scenario batch sizes
	sqlite       bool          // also run the SQLite variants
	repeat       int           // drains per dispatch figure, which is their median
	only         map[string]bool
	smoke        bool
}

// The scenario names -only accepts. "dispatch" selects all its parts; a
// part name selects that part alone.
var (
	scenarioNames = []string{"write", "dispatch", "latency", "backlog", "nats", "amqp", "kafka", "redis", "mysql"}
	dispatchParts = []string{"outbox", "raw", "river", "watermill", "sqlite"}
)

const defaultDSN = "host=127.0.0.1 port=5432 user=postgres dbname=test sslmode=disable"

func postgresDSN() string {
	if dsn := os.Getenv("OUTBOX_POSTGRES_DSN"); dsn != "" {
		return dsn
	}
	return defaultDSN
}

func defaultConfig() config {
	return config{
		dsn:          postgresDSN(),
		duration:     20 * time.Second,
		writeTime:    20 * time.Second,
		backlog:      200_000,
		smallBacklog: 10_000,
		bigBacklog:   1_000_000,
		aggregates:   1000,
		rate:         1000,
		writeClients: []int{1, 8},
		dispatchers:  []int{1, 4},
		batchSizes:   []int{100, 1000},
		sqlite:       true,
		repeat:       3,
	}
}

// smokeConfig shrinks every size and duration so that the whole program
// runs in seconds: it checks that everything works, not how fast.
func smokeConfig(c config) config {
	c.smoke = true
	c.duration = time.Second
	c.writeTime = 300 * time.Millisecond
	c.backlog = 3000
	c.smallBacklog = 1000
	c.bigBacklog = 4000
	c.batchSizes = []int{1000}
	c.repeat = 1
	return c
}

// want reports whether the scenario (or dispatch part) name should run.
func (c config) want(name string) bool {
	if len(c.only) == 0 || c.only[name] {
		return true
	}
	for _, part := range dispatchParts {
		if part == name {
			return c.only["dispatch"]
		}
	}
	return false
}

func main() {
	c := defaultConfig()
	flag.DurationVar(&c.duration, "duration", c.duration, "how long each timed scenario (write, latency) runs")
	flag.IntVar(&c.backlog, "backlog", c.backlog, "events in the dispatch scenario's backlog")
	flag.IntVar(&c.bigBacklog, "big-backlog", c.bigBacklog, "events in the backlog scenario's big backlog")
	flag.IntVar(&c.smallBacklog, "small-backlog", c.smallBacklog, "events in the backlog scenario's small backlog")
	flag.IntVar(&c.aggregates, "aggregates", c.aggregates, "distinct aggregates in loaded backlogs")
	flag.BoolVar(&c.sqlite, "sqlite", c.sqlite, "also run the SQLite variants of write and dispatch")
	flag.IntVar(&c.repeat, "repeat", c.repeat, "drains per dispatch figure, interleaved across systems; the figure is their median")
	flag.Var((*intList)(&c.dispatchers), "dispatchers", "comma-separated dispatcher counts of the dispatch scenario")
	flag.Var((*intList)(&c.batchSizes), "batches", "comma-separated batch sizes of the dispatch scenario")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the whole run (the bench and the library in it) to this file, for go tool pprof")
	smoke := flag.Bool("smoke", false, "tiny sizes and short durations, to check that everything runs (CI)")
	only := flag.String("only", "", "comma-separated scenarios to run: "+strings.Join(scenarioNames, ", ")+
		" (or dispatch parts: "+strings.Join(dispatchParts, ", ")+")")
	flag.Parse()

	if *smoke {
		c = smokeConfig(c)
	} else {
		c.writeTime = c.duration
	}
	var err error
	if c.only, err = parseOnly(*only); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	if err := c.validate(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}

	if err := runProfiled(c, *cpuProfile); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// runProfiled runs the benchmark until it ends or is interrupted, under a
// CPU profile written to path if path is set.
func runProfiled(c config, path string) error {
	if path != "" {
		f, err := os.Create(path)
		if err != nil {
			return fmt.Errorf("-cpuprofile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("-cpuprofile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return run(ctx, c, os.Stdout)
}

func parseOnly(s string) (map[string]bool, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	known := map[string]bool{}
	for _, n := range append(append([]string{}, scenarioNames...), dispatchParts...) {
		known[n] = true
	}
	only := map[string]bool{}
	for _, name := range strings.Split(s, ",") {
		name = strings.TrimSpace(name)
		if name == "" {
			continue
		}
		if !known[name] {
			names := make([]string, 0, len(known))
			for n := range known {
				names = append(names, n)
			}
			sort.Strings(names)
			return nil, fmt.Errorf("-only: unknown scenario %q (known: %s)", name, strings.Join(names, ", "))
		}
		only[name] = true
	}
	return only, nil
}

func (c config) validate() error {
	switch {
	case c.duration < 100*time.Millisecond || c.duration > time.Hour:
		return errors.New("-duration must be between 100ms and 1h")
	case c.backlog < 100 || c.backlog > 20_000_000:
		return errors.New("-backlog must be between 100 and 20,000,000")
	case c.smallBacklog < 100 || c.smallBacklog > 20_000_000:
		return errors.New("-small-backlog must be between 100 and 20,000,000")
	case c.bigBacklog < 100 || c.bigBacklog > 20_000_000:
		return errors.New("-big-backlog must be between 100 and 20,000,000")
	case c.aggregates < 1 || c.aggregates > 1_000_000:
		return errors.New("-aggregates must be between 1 and 1,000,000")
	case c.repeat < 1 || c.repeat > 15:
		return errors.New("-repeat must be between 1 and 15")
	}
	for _, n := range c.dispatchers {
		if n < 1 || n > 64 {
			return errors.New("-dispatchers must list counts between 1 and 64")
		}
	}
	for _, n := range c.batchSizes {
		if n < 1 || n > 100_000 {
			return errors.New("-batches must list sizes between 1 and 100,000")
		}
	}
	return nil
}

// intList is a flag of comma-separated positive integers, as "1,4".
type intList []int

func (l *intList) String() string {
	parts := make([]string, len(*l))
	for i, n := range *l {
		parts[i] = strconv.Itoa(n)
	}
	return strings.Join(parts, ",")
}

func (l *intList) Set(s string) error {
	var out []int
	for _, part := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(part))
		if err != nil {
			return fmt.Errorf("%q is not a number", part)
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return errors.New("empty list")
	}
	*l = out
	return nil
}

// run runs the selected scenarios against the server in c.dsn and writes
// the tables and the final figures to out.
func run(ctx context.Context, c config, out io.Writer) error {
	started := time.Now()
	e, err := newEnv(ctx, c.dsn)
	if err != nil {
		return err
	}
	defer e.close()
	e.checkpoint = !c.smoke

	r := newReport(out)
	fmt.Fprintf(out, "gorm-outbox benchmark: %s\n", e.describe(ctx))
	fmt.Fprintf(out, "load average at the start: %s (other work on this machine skews every figure)\n", loadAverage())
	fmt.Fprintf(out, "settings: duration %v, backlog %d, backlog scenario %d / %d, %d aggregates, smoke %v\n\n",
		c.duration, c.backlog, c.smallBacklog, c.bigBacklog, c.aggregates, c.smoke)

	steps := []struct {
		name string
		fn   func(context.Context, *env, config, *report) error
	}{
		{"write", runWrite},
		{"dispatch", runDispatch},
		{"latency", runLatency},
		{"backlog", runBacklog},
		{"nats", runBrokerNATS},
		{"amqp", runBrokerAMQP},
		{"kafka", runKafka},
		{"redis", runRedis},
		{"mysql", runMySQL},
	}
	for _, s := range steps {
		if !c.want(s.name) && !(s.name == "dispatch" && anyDispatchPart(c)) {
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		t := time.Now()
		if err := s.fn(ctx, e, c, r); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
		fmt.Fprintf(out, "(%s took %v; load average at the end: %s)\n\n", s.name, time.Since(t).Round(time.Second/10), loadAverage())
	}
	r.printFigures()
	fmt.Fprintf(out, "(total %v)\n", time.Since(started).Round(time.Second/10))
	return nil
}

func anyDispatchPart(c config) bool {
	for _, p := range dispatchParts {
		if c.only[p] {
			return true
		}
	}
	return false
}
