;;;; The benchmark per core: each server pinned to processor 0 alone
;;;; (taskset; nginx and Woo with one worker, ours with its pool), wrk with
;;;; one thread pinned to processor 1 alone.  On a machine whose processors
;;;; server and client share, a server that answers in runs saves its client
;;;; work and is paid for it in requests/s (bench/profiles/
;;;; 2026-11-27-woo-side-by-side-costs.txt); apart, each server's requests/s
;;;; and its processor time a request are its own.  The cells: a 0 ms
;;;; handler kept alive over 100 and 1,000 connections, one request per
;;;; connection, 16 requests pipelined in each write, a returning user's
;;;; session counter (ours only: its ratio is to ours' plain handler), and a
;;;; 1 ms handler kept alive.  The threaded floor (bench/threaded-
;;;; floor.lisp, pinned as the others) says what threads that each take one
;;;; connection per epoll_wait can do, at 0 ms and at 1 ms; the engine
;;;; floor (bench/engine-floor.lisp) what ours' engine does at 0 ms before
;;;; Hunchentoot's protocol is run; the protocol floor (bench/protocol-
;;;; floor.lisp) what that protocol leaves of the threaded floor at 1 ms,
;;;; both floors loaded at the same moment each round: a bound on ours.
;;;; Ours' fraction of another server is the median of each round's
;;;; fraction, its two servers measured seconds apart: the machine's speed
;;;; drifts more between rounds
;;;; (bench/profiles/2026-11-29-costs-per-request.txt).
;;;; `bench/run per-core` measures it alone; `make bench` ends with it.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defparameter *per-core-server-processors* "0"
  "The processor every server of the per-core table runs on (taskset's list).")

(defparameter *per-core-client-processors*
  (if (> (hrt::online-processor-count) 1) "1" "0")
  "The processor wrk runs on in the per-core table (taskset's list): the
server's own on a machine of one.")

(defparameter *per-core-cells*
  '((:name "0ms keep-alive c100" :connections 100
     :servers ("parallel" "nginx" "woo" "threaded-floor" "engine-floor"))
    (:name "0ms keep-alive c1000" :connections 1000
     :servers ("parallel" "nginx" "woo" "threaded-floor" "engine-floor"))
    (:name "0ms close c100" :connections 100 :close t :servers ("parallel" "nginx" "woo"))
    (:name "0ms 16 pipelined c100" :connections 100 :pipeline 16 :servers ("parallel" "nginx" "woo"))
    (:name "session c100" :connections 100 :path "/app/counter" :cookie t :servers ("parallel"))
    (:name "1ms keep-alive c100" :connections 100 :delay-ms 1
     :servers ("parallel" "nginx" "threaded-floor" "protocol-floor"))
    (:name "1ms keep-alive c1000" :connections 1000 :delay-ms 1
     :servers ("parallel" "nginx" "threaded-floor" "protocol-floor")))
  "Each cell of the per-core table: its name, wrk's connections, the
handler's delay, :CLOSE for one request per connection, :PIPELINE for that
many requests in each write, :PATH (/yo unless given), :COOKIE for a
returning user's session cookie on every request, and the servers measured
on it.")

(defparameter *per-core-targets*
  '(("0ms keep-alive c100" "nginx" 0.8) ("0ms keep-alive c1000" "nginx" 0.85) ("0ms close c100" "nginx" 1)
    ("0ms 16 pipelined c100" "nginx" 0.5) ("1ms keep-alive c1000" "threaded-floor" 0.9))
  "The fraction of another server's requests/s that ours should reach in a
cell of the per-core table: the cell, the other server, the fraction.")

(defun per-core-target (cell-name server-name)
  "The fraction of SERVER-NAME's requests/s ours should reach in the cell
CELL-NAME (*PER-CORE-TARGETS*), or NIL."
  (third (find-if (lambda (target) (and (string= (first target) cell-name) (string= (second target) server-name)))
                  *per-core-targets*)))

(defparameter *per-core-limit-cell* "1ms keep-alive c1000"
  "The cell whose target against the threaded floor the protocol floor
bounds (MEASURE-PROTOCOL-FLOOR-LIMIT).")

(defparameter *per-core-session-target* 0.6
  "The fraction of ours' plain handler's requests/s that its session cell
should reach.")

(defun per-core-servers (woo)
  "The servers of the per-core table: ours, nginx with one worker, WOO (a
built peer, or NIL) with one worker, and the threaded, engine and protocol
floors."
  (remove nil (list (list :name "parallel" :label "parallel-easy-acceptor" :lisp :parallel)
                    (list :name "nginx" :label "nginx, 1 worker" :nginx t :workers 1)
                    (and woo (list* :workers 1 :label "Woo, 1 worker" woo))
                    *threaded-floor-server*
                    *engine-floor-server*
                    *protocol-floor-server*)))

(defun per-core-wrk-script (directory &key cookie pipeline)
  "A wrk Lua script in DIRECTORY that adds COOKIE to each request and
sends PIPELINE requests in each write, or NIL when neither is asked."
  (when (or cookie pipeline)
    (let ((path (merge-pathnames (format nil "per-core-~D.lua" (random 1000000)) directory)))
      (with-open-file (out path :direction :output :if-exists :supersede)
        (when cookie
          (format out "wrk.headers[\"Cookie\"] = ~S~%" cookie))
        (when pipeline
          (format out "init = function(args)~%  local requests = {}~%  for i = 1, ~D do requests[i] = wrk.format() end~%  ~
                       pipelined = table.concat(requests)~%end~%request = function() return pipelined end~%"
                  pipeline)))
      path)))

(defun per-core-wrk-command (port cell seconds script)
  "The command of one wrk for CELL on PORT for SECONDS, one wrk thread pinned
to *PER-CORE-CLIENT-PROCESSORS*, with SCRIPT when given."
  (destructuring-bind (&key connections close (path "/yo") &allow-other-keys) cell
    (append (list "taskset" "-c" *per-core-client-processors*
                  "wrk" "-t1" (format nil "-c~D" connections) (format nil "-d~Ds" seconds) "--latency")
            (and close (list "-H" "Connection: close"))
            (and script (list "-s" (namestring script)))
            (list (format nil "http://127.0.0.1:~D~A" port path)))))

(defun per-core-wrk (port cell seconds script)
  "wrk's whole output for CELL on PORT for SECONDS (PER-CORE-WRK-COMMAND)."
  (values (uiop:run-program (per-core-wrk-command port cell seconds script)
                            :output :string :error-output :output :ignore-error-status t)))

(defun measure-per-core-cell (server cell &key seconds core directory)
  "Start SERVER pinned to *PER-CORE-SERVER-PROCESSORS*, warm it 2 s,
measure CELL for SECONDS, stop it.  wrk's figures, and :SERVER-USER-US and
:SERVER-SYSTEM-US the server's user and system time a request, :BYTES-CONSED-PER-REQUEST for a
Lisp server; or :FAILED when the server did not answer or ended before it
was stopped (SERVER-ENDED-FAILURE)."
  (let* ((port (free-port))
         (log-file (namestring (merge-pathnames (format nil "per-core-~A.log" (getf server :name)) directory)))
         (process (let ((*server-processors* *per-core-server-processors*))
                    (launch-server server port (getf cell :delay-ms 0) core log-file))))
    (unwind-protect
         (if (not (wait-until-serving port))
             (list :failed "server did not answer GET /yo within 30 s")
             (let* ((script (per-core-wrk-script directory
                                                 :cookie (and (getf cell :cookie) (returning-user-cookie port))
                                                 :pipeline (getf cell :pipeline)))
                    (pid (uiop:process-info-pid process))
                    (lisp (getf server :lisp)))
               (per-core-wrk port cell 2 script)
               (let ((before (and lisp (lisp-counters port))))
                 (multiple-value-bind (output peak-threads processor-seconds)
                     (call-timing-processors pid (lambda ()
                                                   (call-counting-threads
                                                    pid (lambda () (per-core-wrk port cell seconds script)))))
                   (let* ((after (and lisp (lisp-counters port)))
                          (figures (parse-wrk output))
                          (requests (getf figures :requests)))
                     (if (not (uiop:process-alive-p process))
                         (server-ended-failure log-file)
                         (list* :server-user-us (and (plusp requests)
                                                     (/ (* 1000000 (first processor-seconds)) requests))
                                :server-system-us (and (plusp requests)
                                                       (/ (* 1000000 (second processor-seconds)) requests))
                                :peak-threads (and lisp peak-threads)
                                :bytes-consed-per-request (and before after (plusp requests)
                                                               (round (- (getf after :consed) (getf before :consed))
                                                                      requests))
                                figures)))))))
      (stop-server process))))

(defun per-core-errors (figures)
  (+ (getf figures :non-2xx 0) (getf figures :connect-errors 0) (getf figures :read-errors 0)
     (getf figures :write-errors 0) (getf figures :timeout-errors 0)))

(defun per-core-answered-p (figures)
  "True when the measurement FIGURES ran and wrk counted no error and no
reply other than 2xx."
  (and (not (getf figures :failed)) (zerop (per-core-errors figures))))

(defun round-rate (figures)
  "The requests/s of one round's FIGURES, or NIL when that round failed."
  (and (not (getf figures :failed)) (getf figures :requests-per-second)))

(defun paired-ratios (measured cell-name server-name &optional (other-cell-name cell-name))
  "Ours' requests/s in CELL-NAME over SERVER-NAME's in OTHER-CELL-NAME,
round by round, from MEASURED ((cell name, server name) -> each round's
figures, in the same order): the machine's speed drifts from minute to
minute, and a round's two servers ran seconds apart."
  (loop for ours in (gethash (list cell-name "parallel") measured)
        for other in (gethash (list other-cell-name server-name) measured)
        for ratio = (ratio-to (round-rate ours) (round-rate other))
        when ratio collect ratio))

(defun median-ratio (ratios)
  "The median of RATIOS (the lower middle one of an even count), or NIL."
  (and ratios (nth (floor (1- (length ratios)) 2) (sort (copy-list ratios) #'<))))

(defun ratios-text (ratios)
  "RATIOS' median, and their range when there are several."
  (format nil "~A~:[~; (~A-~A)~]" (ratio-text (median-ratio ratios)) (rest ratios)
          (ratio-text (reduce #'min ratios)) (ratio-text (reduce #'max ratios))))

(defun per-core-summary (cells measured same-moment limits servers rounds seconds)
  "The markdown report of CELLS ((cell name, server name) -> median figures)
and, round by round, ours' fractions of the others (PAIRED-RATIOS of
MEASURED), ours' session cell over its plain handler at the same moment
(SAME-MOMENT, each round's figures of MEASURE-SESSION-AT-SAME-MOMENT) and
the protocol floor over the threaded floor at the same moment (LIMITS, each
round's figures of MEASURE-PROTOCOL-FLOOR-LIMIT)."
  (with-output-to-string (out)
    (format out "Per core: each server pinned to processor ~A alone (nginx and Woo with one worker, ours with ~
                 its pool), wrk -t1 pinned to processor ~A; the median of ~D round~:P of ~D s a cell.  ~
                 Requests/s, then the server's user + system time a request in microseconds (and a Lisp ~
                 server's most threads):~%~%| cell |~
                 ~{ ~A |~}~%|---|~{~A~}~%"
            *per-core-server-processors* *per-core-client-processors* rounds seconds
            (mapcar (lambda (server) (getf server :name)) servers) (mapcar (constantly "---:|") servers))
    (dolist (cell *per-core-cells*)
      (format out "| ~A |" (getf cell :name))
      (dolist (server servers)
        (let ((figures (gethash (list (getf cell :name) (getf server :name)) cells)))
          (format out " ~A |"
                  (cond ((null figures) "-")
                        ((getf figures :failed) (format nil "failed (~A)" (getf figures :failed)))
                        (t (format nil "~D (~,1F + ~,1F us~@[, ~D threads~])~:[~*~; ~D errors~]"
                                   (round (getf figures :requests-per-second))
                                   (getf figures :server-user-us) (getf figures :server-system-us)
                                   (getf figures :peak-threads)
                                   (plusp (per-core-errors figures)) (per-core-errors figures)))))))
      (terpri out))
    (format out "~%Ours as a fraction of each other server, cell by cell: the median of the rounds' ~
                 fractions, each of two servers measured seconds apart (their range in brackets):~%~%~
                 | cell | of | fraction | target |~%|---|---|---:|---:|~%")
    (dolist (cell *per-core-cells*)
      (dolist (server-name (rest (getf cell :servers)))
        (let ((ratios (paired-ratios measured (getf cell :name) server-name))
              (target (per-core-target (getf cell :name) server-name)))
          (when ratios
            (format out "| ~A | ~A | ~A | ~:[-~;~:*~A~] |~%" (getf cell :name) server-name (ratios-text ratios)
                    (and target (format nil "~A ~:[below~;ok~]" target (>= (median-ratio ratios) target))))))))
    (let ((session (paired-ratios measured "session c100" "parallel" "0ms keep-alive c100"))
          (consed (getf (gethash (list "0ms keep-alive c100" "parallel") cells) :bytes-consed-per-request))
          (objects (request-objects-bytes)))
      (when session
        (format out "~%Ours' session cell as a fraction of ours' 0 ms keep-alive c100: ~A (target ~A: ~:[below~;ok~]).~%"
                (ratios-text session) *per-core-session-target*
                (>= (median-ratio session) *per-core-session-target*)))
      (let ((together (remove nil (mapcar #'same-moment-ratio same-moment))))
        (when together
          (format out "~%The same two at the same moment (two processes of ours on processor ~A, each loaded by a ~
                       wrk of its own on processor ~A, started together), requests per processor second, ~
                       session over plain: ~A (target ~A: ~:[below~;ok~]); each round's plain / session ~
                       processor time a request: ~{~A~^, ~} us.~%"
                  *per-core-server-processors* *per-core-client-processors*
                  (ratios-text together) *per-core-session-target*
                  (>= (median-ratio together) *per-core-session-target*)
                  (mapcar (lambda (figures)
                            (if (some (lambda (f) (getf f :failed)) figures)
                                "failed"
                                (format nil "~{~,1F~^ / ~}" (mapcar (lambda (f) (getf f :server-us)) figures))))
                          same-moment))))
      (let ((bounds (remove nil (mapcar #'same-moment-ratio limits)))
            (target (per-core-target *per-core-limit-cell* "threaded-floor")))
        (when bounds
          (format out "~%The protocol floor over the threaded floor in ~A at the same moment (both pinned to ~
                       processor ~A, each loaded by a wrk of its own), requests per processor second: ~A: what ~
                       answering through Hunchentoot's protocol leaves of the threaded floor.  Ours does that work ~
                       and more, in one system call fewer a request of about five (it parks a connection ~
                       edge-triggered where the floors arm it again): this bounds ours' fraction of the threaded ~
                       floor to within that call.  Its target, ~A, is ~:[above~;within~] the bound.~%"
                  *per-core-limit-cell* *per-core-server-processors* (ratios-text bounds) target
                  (<= target (median-ratio bounds)))))
      (when consed
        (format out "~%Bytes consed a kept-alive request by ours (0 ms, c100, the whole process): ~D, of which ~D ~
                     are Hunchentoot's request and reply objects: ~D beyond them.~%"
                consed objects (- consed objects))))))

(defun run-per-core (&key core (rounds 3) (seconds 5) directory)
  "Measure every cell of *PER-CORE-CELLS* on its servers, ROUNDS rounds in
turn, and print the report; with DIRECTORY (a matrix run's), append it to
its summary.md and write per-core.md there, else write
bench/results/<UTC timestamp>-per-core.md.  True when ours answered every
request of every cell with a 2xx."
  (let* ((work (uiop:ensure-directory-pathname
                (string-right-trim '(#\Newline) (uiop:run-program '("mktemp" "-d") :output :string))))
         (woo-peer (find "woo" (available-peers) :key (lambda (peer) (getf peer :name)) :test #'string=))
         (servers (per-core-servers (and woo-peer (build-peer-core woo-peer (namestring work)))))
         (measured (make-hash-table :test #'equal))
         (cells (make-hash-table :test #'equal))
         (same-moment '())
         (limits '()))
    (unless woo-peer
      (announce-missing-peers))
    (unwind-protect
         (loop for round from 1 to rounds
               do (dolist (cell *per-core-cells*)
                    (dolist (server servers)
                      (when (member (getf server :name) (getf cell :servers) :test #'string=)
                        (format t "~&Per core, round ~D of ~D: ~A, ~A~%" round rounds (getf cell :name) (getf server :name))
                        (finish-output)
                        (let ((figures (measure-per-core-cell server cell :seconds seconds :core core
                                                                             :directory work)))
                          (when (getf figures :failed)
                            (format t "~&  failed: ~A~%" (getf figures :failed)))
                          (push figures (gethash (list (getf cell :name) (getf server :name)) measured))))))
                  (format t "~&Per core, round ~D of ~D: session c100 and 0ms keep-alive c100 at the same moment~%"
                          round rounds)
                  (finish-output)
                  (push (measure-session-at-same-moment (first servers) :seconds seconds :core core
                                                                        :directory work)
                        same-moment)
                  (format t "~&Per core, round ~D of ~D: the threaded and protocol floors in ~A at the same moment~%"
                          round rounds *per-core-limit-cell*)
                  (finish-output)
                  (push (measure-protocol-floor-limit :seconds seconds :core core :directory work) limits))
      (uiop:delete-directory-tree work :validate t :if-does-not-exist :ignore))
    (maphash (lambda (key rounds) (setf (gethash key cells) (median-cell rounds))) measured)
    (write-suite-report (per-core-summary cells measured (reverse same-moment) (reverse limits) servers rounds seconds)
                        "per-core" directory)
    (and (loop for key being the hash-keys of cells using (hash-value figures)
               always (or (string/= (second key) "parallel")
                          (per-core-answered-p figures)))
         (every (lambda (figures) (every #'per-core-answered-p figures)) same-moment))))
