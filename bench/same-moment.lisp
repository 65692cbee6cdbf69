;;;; Two builds of ours measured at the same moment: both pinned to
;;;; processor 0, each loaded by a wrk of its own pinned to processor 1, the
;;;; two wrk started together.  Each build's figure is its requests per
;;;; second of its own processor time (user + system): a server that keeps
;;;; its processor busy answers one over that time a second.  Measured run
;;;; after run, the machine's drift decides: ours' rate moved 2x from one
;;;; second to the next in one process, nginx's 1.6x; at the same moment
;;;; the drift falls on both alike, and the same build against itself
;;;; stayed within 0.94-1.06
;;;; (bench/profiles/2026-11-29-same-moment.txt).  Sharing the processor,
;;;; each pays for the other's use of the caches, alike when both are ours:
;;;; the ratio compares two builds of ours, not ours with another server,
;;;; whose share of the processor and whose caches differ.
;;;; `bench/run same-moment REVISION [ROUNDS [SECONDS]]`.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defparameter *same-moment-cells*
  (remove-if-not (lambda (cell)
                   (member (getf cell :name) '("0ms keep-alive c100" "0ms keep-alive c1000" "session c100"
                                               "1ms keep-alive c1000")
                           :test #'string=))
                 *per-core-cells*)
  "The cells of the per-core table (*PER-CORE-CELLS*) two builds of ours are
measured on at the same moment: the kept-alive ones that are ours' own
cost a request.")

(defun same-moment-figures (output processor-seconds)
  "One build's figures from its wrk OUTPUT and the PROCESSOR-SECONDS (user,
system) its server used meanwhile: wrk's, and :REQUESTS-PER-PROCESSOR-SECOND."
  (let* ((figures (parse-wrk output))
         (requests (getf figures :requests))
         (seconds (reduce #'+ processor-seconds)))
    (list* :requests-per-processor-second (and requests (plusp requests) (plusp seconds) (/ requests seconds))
           :server-us (and requests (plusp requests) (/ (* 1000000 seconds) requests))
           figures)))

(defun launch-wrk (port cell seconds script)
  "Start the wrk PER-CORE-WRK runs for CELL on PORT for SECONDS with SCRIPT;
its process-info, whose output stream gives wrk's report."
  (uiop:launch-program (per-core-wrk-command port cell seconds script) :output :stream :error-output :output))

(defun wrk-together (ports cells seconds scripts)
  "Run a wrk on each of PORTS for its cell of CELLS (with the SCRIPTS, in
order) for SECONDS, all started together; their outputs, in order."
  (let ((processes (mapcar (lambda (port cell script) (launch-wrk port cell seconds script)) ports cells scripts)))
    (mapcar (lambda (process)
              (prog1 (uiop:slurp-stream-string (uiop:process-info-output process))
                (uiop:wait-process process)))
            processes)))

(defun measure-same-moment-cell (servers cells &key seconds core directory)
  "Start SERVERS (two) pinned to *PER-CORE-SERVER-PROCESSORS*, warm them 2 s
together, measure each on its cell of CELLS at once for SECONDS, stop them.
Each one's SAME-MOMENT-FIGURES, in order, or a list of :FAILED plists."
  (let* ((ports (mapcar (lambda (server) (declare (ignore server)) (free-port)) servers))
         (processes (let ((*server-processors* *per-core-server-processors*))
                      (mapcar (lambda (server port cell)
                                (launch-server server port (getf cell :delay-ms 0) core
                                               (namestring (merge-pathnames (format nil "same-moment-~D.log" port)
                                                                            directory))))
                              servers ports cells))))
    (unwind-protect
         (if (notevery #'wait-until-serving ports)
             (mapcar (constantly (list :failed "server did not answer GET /yo within 30 s")) servers)
             (let ((scripts (mapcar (lambda (port cell)
                                      (per-core-wrk-script directory :cookie (and (getf cell :cookie)
                                                                                  (returning-user-cookie port))))
                                    ports cells))
                   (pids (mapcar #'uiop:process-info-pid processes)))
               (wrk-together ports cells 2 scripts)
               (let* ((before (mapcar (lambda (pid) (multiple-value-list (server-processor-seconds pid))) pids))
                      (outputs (wrk-together ports cells seconds scripts))
                      (after (mapcar (lambda (pid) (multiple-value-list (server-processor-seconds pid))) pids)))
                 (mapcar (lambda (output before after) (same-moment-figures output (mapcar #'- after before)))
                         outputs before after))))
      (mapc #'stop-server processes))))

(defun same-moment-ratio (figures)
  "The second build's requests per processor second over the first's, of one
round's FIGURES (two), or NIL when either failed or answered other than 2xx."
  (destructuring-bind (first second) figures
    (and (every #'per-core-answered-p figures)
         (ratio-to (getf second :requests-per-processor-second) (getf first :requests-per-processor-second)))))

(defun measure-session-at-same-moment (server &key seconds core directory)
  "Ours' session cell and its plain handler (the per-core table's \"session
c100\" and \"0ms keep-alive c100\") measured at the same moment, each on a
process of SERVER of its own (MEASURE-SAME-MOMENT-CELL): the plain one's
figures, then the session's.  Run after run, a session request's processor
time moved as much as the machine's speed; at the same moment the drift falls
on both (bench/profiles/2026-12-02-session-at-the-same-moment.txt)."
  (flet ((cell (name) (find name *per-core-cells* :key (lambda (cell) (getf cell :name)) :test #'string=)))
    (measure-same-moment-cell (list server server) (list (cell "0ms keep-alive c100") (cell "session c100"))
                              :seconds seconds :core core :directory directory)))

(defun measure-protocol-floor-limit (&key seconds core directory)
  "The threaded floor's figures and the protocol floor's on the per-core
table's *PER-CORE-LIMIT-CELL*, both loaded at the same moment
(MEASURE-SAME-MOMENT-CELL): the protocol floor's requests per processor
second over the threaded floor's bounds ours' fraction of the threaded
floor there.  At the same moment, as the two floors' ratio moves far less
than one after the other (bench/profiles/2026-12-04-protocol-floor.txt).
Ours cannot be measured so against a floor: both take the processor by
threads, and a floor's hundred always-waiting threads leave ours' pool a
smaller share."
  (let ((cell (find *per-core-limit-cell* *per-core-cells* :key (lambda (cell) (getf cell :name)) :test #'string=)))
    (measure-same-moment-cell (list *threaded-floor-server* *protocol-floor-server*) (list cell cell)
                              :seconds seconds :core core :directory directory)))

(defun same-moment-summary (measured servers rounds seconds)
  "The markdown report of MEASURED (cell name -> each round's figures of
both SERVERS)."
  (with-output-to-string (out)
    (format out "Same moment: ~A and ~A, both pinned to processor ~A, each loaded by a wrk -t1 of its own pinned ~
                 to processor ~A, the two started together; ~D round~:P of ~D s a cell.  Each round: requests/s, ~
                 the server's processor time a request (us), and the second's requests per processor second over ~
                 the first's:~%~%| cell | rounds | ratio (median) |~%|---|---|---:|~%"
            (getf (first servers) :label) (getf (second servers) :label)
            *per-core-server-processors* *per-core-client-processors* rounds seconds)
    (dolist (cell *same-moment-cells*)
      (let* ((cell-rounds (reverse (gethash (getf cell :name) measured)))
             (ratios (remove nil (mapcar #'same-moment-ratio cell-rounds))))
        (format out "| ~A | ~{~A~^; ~} | ~:[-~;~:*~A~] |~%" (getf cell :name)
                (mapcar (lambda (figures)
                          (format nil "~{~A~^ / ~}~@[ ~A~]"
                                  (mapcar (lambda (f)
                                            (if (getf f :failed)
                                                "failed"
                                                (format nil "~D (~,1F us~:[~*~;, ~D errors~])"
                                                        (round (getf f :requests-per-second)) (getf f :server-us)
                                                        (plusp (per-core-errors f)) (per-core-errors f))))
                                          figures)
                                  (let ((ratio (same-moment-ratio figures))) (and ratio (ratio-text ratio)))))
                        cell-rounds)
                (and ratios (ratios-text ratios)))))))

(defun run-same-moment (&key revision revision-core core (rounds 5) (seconds 5) directory)
  "Measure ours at REVISION (built as REVISION-CORE) and ours as checked out
(CORE) at the same moment on each of *SAME-MOMENT-CELLS*, ROUNDS rounds in
turn, and print and write the report (WRITE-SUITE-REPORT).  True when both
answered every request with a 2xx."
  (let ((servers (list (list :name "revision" :label (format nil "ours at ~A" revision) :lisp :parallel
                             :core revision-core)
                       (list :name "checkout" :label "ours as checked out" :lisp :parallel)))
        (measured (make-hash-table :test #'equal))
        (work (uiop:ensure-directory-pathname
               (string-right-trim '(#\Newline) (uiop:run-program '("mktemp" "-d") :output :string)))))
    (unwind-protect
         (loop for round from 1 to rounds
               do (dolist (cell *same-moment-cells*)
                    (format t "~&Same moment, round ~D of ~D: ~A~%" round rounds (getf cell :name))
                    (finish-output)
                    (push (measure-same-moment-cell servers (list cell cell) :seconds seconds :core core
                                                                                :directory work)
                          (gethash (getf cell :name) measured))))
      (uiop:delete-directory-tree work :validate t :if-does-not-exist :ignore))
    (write-suite-report (same-moment-summary measured servers rounds seconds) "same-moment" directory)
    (loop for cell-rounds being the hash-values of measured
          always (every (lambda (figures) (every #'per-core-answered-p figures)) cell-rounds))))
