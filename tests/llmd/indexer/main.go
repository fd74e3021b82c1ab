// llmd-indexer: llm-d's KV-cache indexer (github.com/llm-d/llm-d-kv-cache, pinned in go.mod),
// wired the way the llm-d router's precise-prefix-cache-producer wires it, behind a small HTTP
// API on 127.0.0.1 for tests and benchmarks.
//
// The wiring follows the producer's New() (llm-d/llm-d-router
// pkg/epp/framework/plugins/requestcontrol/dataproducer/preciseprefixcache/producer.go):
// kvblock.NewChunkedTokenDatabase(tokenProcessorConfig), kvcache.NewKVCacheIndexer,
// kvcache.NewKVBlockScorer(DefaultKVBlockScorerConfig with indexerConfig's backend weights),
// engineadapter.NewAdapter(kvEventsConfig.engineType), kvevents.NewPool(...).Start and a
// kvevents.SubscriberManager that dials each pod's ZMQ endpoint (the router's pod discovery
// calls EnsureSubscriber the same way). There is no tokenizer: requests carry token ids, as the
// router's token-producer hands them to the producer.
//
// Only the parameters parsing, the HTTP layer and a per-pod sequence tracker are ours. The
// tracker wraps the engine adapter to learn which messages the pool has taken, so that a test
// can wait for "the events of this request are in the index" instead of sleeping.
//
//	llmd-indexer --config '<precise-prefix-cache-producer parameters as JSON>'
//
// prints {"listen": "127.0.0.1:PORT"} once serving. API (JSON):
//
//	POST /subscribe   {"pod": "ip:port", "endpoint": "tcp://ip:port"}
//	POST /unsubscribe {"pod": "ip:port"}
//	POST /forget      {"pod": "ip:port"}  forget the sequence numbers seen (engine restarted)
//	GET  /sync?pod=P&seq=N&timeout_s=T    200 once message N of P and all before it are processed
//	POST /score       {"tokens": [...], "model": "m", "pods": [...]}  (pods: empty = all)
//	GET  /healthz
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
	"k8s.io/apimachinery/pkg/util/sets"
)

// pluginConfig is the parameters block of a precise-prefix-cache-producer plugin in an
// EndpointPickerConfig (the producer's PluginConfig, minus speculative indexing, which a
// test of what engines announce must not use).
type pluginConfig struct {
	TokenProcessorConfig *kvblock.TokenProcessorConfig `json:"tokenProcessorConfig"`
	IndexerConfig        *kvcache.Config               `json:"indexerConfig"`
	KVEventsConfig       *kvevents.Config              `json:"kvEventsConfig"`
}

// tracker wraps the engine adapter: the pool calls ParseMessage in order per pod, each message
// after the previous one of the same pod was fully processed, so a marker message parsed after
// message N proves N is in the index.
type tracker struct {
	kvevents.EngineAdapter
	mu      sync.Mutex
	cond    *sync.Cond
	seen    map[string]map[uint64]bool // pod -> sequence numbers parsed since the last forget
	markers map[*kvevents.RawMessage]chan struct{}
}

func newTracker(inner kvevents.EngineAdapter) *tracker {
	t := &tracker{EngineAdapter: inner, seen: map[string]map[uint64]bool{},
		markers: map[*kvevents.RawMessage]chan struct{}{}}
	t.cond = sync.NewCond(&t.mu)
	return t
}

func (t *tracker) ParseMessage(msg *kvevents.RawMessage) (string, string, kvevents.EventBatch, error) {
	t.mu.Lock()
	if done, ok := t.markers[msg]; ok {
		delete(t.markers, msg)
		t.mu.Unlock()
		close(done)
		return "", "", kvevents.EventBatch{}, nil // an empty batch: the pool does nothing with it
	}
	t.mu.Unlock()
	pod, model, batch, err := t.EngineAdapter.ParseMessage(msg)
	t.mu.Lock()
	if t.seen[pod] == nil {
		t.seen[pod] = map[uint64]bool{}
	}
	t.seen[pod][msg.Sequence] = true
	t.cond.Broadcast()
	t.mu.Unlock()
	return pod, model, batch, err
}

func (t *tracker) forget(pod string) {
	t.mu.Lock()
	delete(t.seen, pod)
	t.mu.Unlock()
}

// waitParsed waits until message seq of pod was parsed (or the deadline passes).
func (t *tracker) waitParsed(pod string, seq uint64, deadline time.Time) bool {
	timer := time.AfterFunc(time.Until(deadline), func() { t.mu.Lock(); t.cond.Broadcast(); t.mu.Unlock() })
	defer timer.Stop()
	t.mu.Lock()
	defer t.mu.Unlock()
	for !t.seen[pod][seq] {
		if !time.Now().Before(deadline) {
			return false
		}
		t.cond.Wait()
	}
	return true
}

type server struct {
	ctx         context.Context
	cfg         pluginConfig
	processor   kvblock.TokenProcessor
	index       kvblock.Index
	scorer      kvcache.KVBlockScorer
	pool        *kvevents.Pool
	subscribers *kvevents.SubscriberManager
	tracker     *tracker
}

func newServer(ctx context.Context, raw string) (*server, error) {
	indexerConfig, err := kvcache.NewDefaultConfig()
	if err != nil {
		return nil, err
	}
	cfg := pluginConfig{IndexerConfig: indexerConfig, KVEventsConfig: kvevents.DefaultConfig()}
	if raw != "" {
		if err := json.NewDecoder(strings.NewReader(raw)).Decode(&cfg); err != nil {
			return nil, fmt.Errorf("parameters: %w", err)
		}
	}
	if cfg.IndexerConfig == nil {
		return nil, errors.New("indexerConfig is required")
	}
	if cfg.TokenProcessorConfig == nil {
		cfg.TokenProcessorConfig = kvblock.DefaultTokenProcessorConfig()
	}
	processor, err := kvblock.NewChunkedTokenDatabase(cfg.TokenProcessorConfig)
	if err != nil {
		return nil, err
	}
	indexer, err := kvcache.NewKVCacheIndexer(ctx, cfg.IndexerConfig, processor)
	if err != nil {
		return nil, err
	}
	go indexer.Run(ctx)
	scorerConfig := kvcache.DefaultKVBlockScorerConfig()
	if cfg.IndexerConfig.BackendConfigs != nil {
		scorerConfig.BackendConfigs = cfg.IndexerConfig.BackendConfigs
	}
	scorer, err := kvcache.NewKVBlockScorer(scorerConfig)
	if err != nil {
		return nil, err
	}
	adapter, err := engineadapter.NewAdapter(cfg.KVEventsConfig.EngineType)
	if err != nil {
		return nil, err
	}
	tr := newTracker(adapter)
	pool := kvevents.NewPool(cfg.KVEventsConfig, indexer.KVBlockIndex(), processor, tr)
	pool.Start(ctx)
	return &server{ctx: ctx, cfg: cfg, processor: processor, index: indexer.KVBlockIndex(), scorer: scorer,
		pool: pool, subscribers: kvevents.NewSubscriberManager(pool), tracker: tr}, nil
}

type podReq struct {
	Pod      string `json:"pod"`
	Endpoint string `json:"endpoint"`
}

func (s *server) subscribe(w http.ResponseWriter, r *http.Request) {
	var req podReq
	if !decode(w, r, &req) {
		return
	}
	if req.Pod == "" || req.Endpoint == "" {
		httpError(w, http.StatusBadRequest, "pod and endpoint are required")
		return
	}
	// As the router's pod discovery does: dial the pod's endpoint (remote socket).
	if err := s.subscribers.EnsureSubscriber(s.ctx, req.Pod, req.Endpoint, s.cfg.KVEventsConfig.TopicFilter, true); err != nil {
		httpError(w, http.StatusInternalServerError, err.Error())
		return
	}
	writeJSON(w, map[string]any{"subscribed": req.Pod})
}

func (s *server) unsubscribe(w http.ResponseWriter, r *http.Request) {
	var req podReq
	if !decode(w, r, &req) {
		return
	}
	s.subscribers.RemoveSubscriber(s.ctx, req.Pod)
	writeJSON(w, map[string]any{"unsubscribed": req.Pod})
}

func (s *server) forget(w http.ResponseWriter, r *http.Request) {
	var req podReq
	if !decode(w, r, &req) {
		return
	}
	s.tracker.forget(req.Pod)
	writeJSON(w, map[string]any{"forgot": req.Pod})
}

func (s *server) sync(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	pod := q.Get("pod")
	seq, err := strconv.ParseUint(q.Get("seq"), 10, 64)
	if pod == "" || err != nil {
		httpError(w, http.StatusBadRequest, "pod and seq are required")
		return
	}
	timeout := 10.0
	if v := q.Get("timeout_s"); v != "" {
		if timeout, err = strconv.ParseFloat(v, 64); err != nil {
			httpError(w, http.StatusBadRequest, "timeout_s: "+err.Error())
			return
		}
	}
	deadline := time.Now().Add(time.Duration(timeout * float64(time.Second)))
	if !s.tracker.waitParsed(pod, seq, deadline) {
		httpError(w, http.StatusGatewayTimeout, fmt.Sprintf("message %d of %s not received", seq, pod))
		return
	}
	// A marker on the pod's queue: parsed only after the messages before it were processed.
	marker := &kvevents.RawMessage{Topic: "kv@" + pod + "@marker"}
	done := make(chan struct{})
	s.tracker.mu.Lock()
	s.tracker.markers[marker] = done
	s.tracker.mu.Unlock()
	s.pool.AddTask(marker)
	select {
	case <-done:
		writeJSON(w, map[string]any{"pod": pod, "seq": seq})
	case <-time.After(time.Until(deadline)):
		httpError(w, http.StatusGatewayTimeout, "the pool did not process the marker")
	}
}

type scoreReq struct {
	Tokens []uint32 `json:"tokens"`
	Model  string   `json:"model"`
	Pods   []string `json:"pods"`
}

type podScore struct {
	Score         float64        `json:"score"`
	MatchedBlocks int            `json:"matchedBlocks"` // consecutive blocks from the first, any tier
	Tiers         map[string]int `json:"tiers"`         // per tier, consecutive blocks from the first
}

func (s *server) score(w http.ResponseWriter, r *http.Request) {
	var req scoreReq
	if !decode(w, r, &req) {
		return
	}
	keys, err := s.processor.TokensToKVBlockKeys(kvblock.EmptyBlockHash, req.Tokens, req.Model, nil)
	if err != nil {
		httpError(w, http.StatusBadRequest, err.Error())
		return
	}
	out := map[string]any{"blockSizeTokens": s.processor.BlockSize(), "totalBlocks": len(keys)}
	pods := map[string]*podScore{}
	if len(keys) > 0 {
		keyToPods, err := s.index.Lookup(r.Context(), keys, sets.New(req.Pods...))
		if err != nil {
			httpError(w, http.StatusInternalServerError, err.Error())
			return
		}
		scores, err := s.scorer.Score(r.Context(), keys, keyToPods)
		if err != nil {
			httpError(w, http.StatusInternalServerError, err.Error())
			return
		}
		for pod, sc := range scores {
			pods[pod] = &podScore{Score: sc, Tiers: map[string]int{}}
		}
		// As the producer's matchedBlockCount and matchedBlockCountByTier count: the blocks
		// from the first that the pod holds (in any tier), and per tier the blocks from the
		// first that it holds in that tier.
		for pod, ps := range pods {
			anyTier := true
			for i, k := range keys {
				tiers := map[string]bool{}
				for _, e := range keyToPods[k] {
					if e.PodIdentifier == pod {
						tiers[e.DeviceTier] = true
					}
				}
				if anyTier = anyTier && len(tiers) > 0; anyTier {
					ps.MatchedBlocks++
				}
				for t := range tiers {
					if ps.Tiers[t] == i { // held in t at every block before this one
						ps.Tiers[t]++
					}
				}
			}
		}
	}
	order := make([]string, 0, len(pods))
	for pod := range pods {
		order = append(order, pod)
	}
	sort.Slice(order, func(i, j int) bool {
		if pods[order[i]].Score != pods[order[j]].Score {
			return pods[order[i]].Score > pods[order[j]].Score
		}
		return order[i] < order[j]
	})
	out["pods"] = pods
	out["order"] = order
	writeJSON(w, out)
}

func decode(w http.ResponseWriter, r *http.Request, v any) bool {
	if r.Method != http.MethodPost {
		httpError(w, http.StatusMethodNotAllowed, "POST only")
		return false
	}
	if err := json.NewDecoder(r.Body).Decode(v); err != nil {
		httpError(w, http.StatusBadRequest, err.Error())
		return false
	}
	return true
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

func httpError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]string{"error": msg})
}

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "HTTP address (loopback only)")
	config := flag.String("config", "", "precise-prefix-cache-producer parameters (JSON)")
	flag.Parse()
	host, _, err := net.SplitHostPort(*listen)
	if err != nil || !net.ParseIP(host).IsLoopback() {
		log.Fatalf("--listen must be a loopback address, got %q", *listen)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	s, err := newServer(ctx, *config)
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/subscribe", s.subscribe)
	mux.HandleFunc("/unsubscribe", s.unsubscribe)
	mux.HandleFunc("/forget", s.forget)
	mux.HandleFunc("/sync", s.sync)
	mux.HandleFunc("/score", s.score)
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, map[string]bool{"ok": true}) })
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatal(err)
	}
	ready, _ := json.Marshal(map[string]any{"listen": ln.Addr().String(), "blockSizeTokens": s.processor.BlockSize()})
	fmt.Println(string(ready))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { <-ctx.Done(); _ = srv.Close() }()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Fatal(err)
	}
	s.subscribers.Shutdown(context.Background())
	s.pool.Shutdown(context.Background())
}
