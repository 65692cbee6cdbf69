;;;; What a session store costs a request: ours (PARALLEL-EASY-ACCEPTOR) in
;;;; a process of its own, its sessions in the process or in PostgreSQL (a
;;;; throwaway cluster on a Unix socket, tools/postgresql-cluster.lisp),
;;;; serving GET /session, which reads a counter from the request's session
;;;; and writes it back one higher.  wrk sends each request with the cookie
;;;; of one of SESSIONS sessions made beforehand, in turn, so that every
;;;; request reads and writes a session that exists.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(ht:define-easy-handler (session-counter :uri "/session") ()
  (setf (ht:content-type*) "text/plain")
  (princ-to-string (setf (ht:session-value 'hits) (1+ (or (ht:session-value 'hits) 0)))))

(defun serve-sessions (port &key postgresql-host)
  "Serve /session on 127.0.0.1:PORT until killed, the sessions in the
PostgreSQL cluster whose socket is in POSTGRESQL-HOST, or in the process."
  (start-hunchentoot port 'hrt:parallel-easy-acceptor
                     :session-store (and postgresql-host
                                         (hrt:make-postgresql-session-store :database "postgres" :user "postgres"
                                                                            :host postgresql-host)))
  (loop (sleep 3600)))

(defun new-session-cookie (port)
  "The Cookie header value of a new session of the server on PORT."
  (let* ((head (nth-value 1 (send-and-read-reply
                             port (map '(vector (unsigned-byte 8)) #'char-code
                                       (format nil "GET /session HTTP/1.1~C~CHost: localhost~C~C~
                                                    Connection: close~C~C~C~C"
                                               #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed
                                               #\Return #\Linefeed)))))
         (match (nth-value 1 (cl-ppcre:scan-to-strings "(?im)^set-cookie: ([^;\\r]+)" head))))
    (and match (aref match 0))))

(defun session-wrk-script (cookies directory)
  "A wrk Lua script, written in DIRECTORY, sending each request with the next of COOKIES; its path."
  (let ((path (merge-pathnames "sessions.lua" directory)))
    (with-open-file (out path :direction :output :if-exists :supersede)
      (format out "cookies = {~{~S~^, ~}}~%counter = 0~%~
                   request = function()~%  counter = counter + 1~%  ~
                   return wrk.format(\"GET\", \"/session\", {[\"Cookie\"] = cookies[(counter % #cookies) + 1]})~%~
                   end~%"
              cookies))
    path))

(defun session-cell (store cluster seconds connections sessions core directory)
  "wrk's parsed figures for STORE (:in-process or :postgresql) serving
/session to CONNECTIONS connections for SECONDS, over SESSIONS sessions."
  (let* ((port (free-port))
         (process (uiop:launch-program
                   (list "sbcl" "--core" core "--noinform" "--non-interactive" "--disable-debugger"
                         "--eval" (format nil "(hunchentoot-recycling-taskmaster-bench::serve-sessions ~D~@[ :postgresql-host ~S~])"
                                          port (and (eq store :postgresql)
                                                    (postgresql-cluster:postgresql-cluster-socket-directory cluster))))
                   :output nil :error-output nil)))
    (unwind-protect
         (progn
           (loop repeat 300 until (ignore-errors (new-session-cookie port)) do (sleep 0.1))
           (let* ((cookies (loop repeat sessions collect (new-session-cookie port)))
                  (script (session-wrk-script cookies directory)))
             (when (some #'null cookies)
               (error "The ~(~A~) server gave a request no session" store))
             ;; Warm up: the pool's threads and the store's connections.
             (uiop:run-program (list "wrk" "-t2" (format nil "-c~D" connections) "-d2s" "-s" (namestring script)
                                     (format nil "http://127.0.0.1:~D/session" port))
                               :output nil :ignore-error-status t)
             (parse-wrk (uiop:run-program (list "wrk" "-t2" (format nil "-c~D" connections) (format nil "-d~Ds" seconds)
                                                "--latency" "-s" (namestring script)
                                                (format nil "http://127.0.0.1:~D/session" port))
                                          :output :string :error-output :output :ignore-error-status t))))
      (stop-server process))))

(defun run-sessions (&key (seconds 10) (connections 50) (sessions 1000) (rounds 3) core)
  "Print requests/s and latency of GET /session with sessions in the
process and in PostgreSQL, ROUNDS rounds side by side, and the median of
each.  True when every request of every round was answered 2xx."
  (let ((cluster (postgresql-cluster:start-postgresql-cluster))
        (directory (uiop:ensure-directory-pathname (string-right-trim '(#\Newline)
                                                                      (uiop:run-program '("mktemp" "-d") :output :string))))
        (stores '(:in-process :postgresql)))
    (unwind-protect
         (let ((cells (loop repeat rounds
                            collect (mapcar (lambda (store)
                                              (session-cell store cluster seconds connections sessions core directory))
                                            stores))))
           (format t "~&A handler that reads and writes one session value (GET /session), ours, ~
                      wrk -t2 -c~D for ~D s a round over ~D sessions; sessions in the process or in ~
                      PostgreSQL ~A (a local cluster on a Unix socket)~%~%~
                      | round | store | requests/s | p50 ms | p99 ms | non-2xx | socket errors |~%~
                      |---|---|---:|---:|---:|---:|---:|~%"
                   connections seconds sessions
                   (string-trim '(#\Newline) (uiop:run-program '("pg_config" "--version") :output :string
                                                                                       :ignore-error-status t)))
           (loop for round from 1
                 for results in cells
                 do (loop for store in stores
                          for cell in results
                          do (format t "| ~D | ~(~A~) | ~D | ~,2F | ~,2F | ~D | ~D |~%" round store
                                     (round (getf cell :requests-per-second)) (getf cell :p50-ms) (getf cell :p99-ms)
                                     (getf cell :non-2xx)
                                     (+ (getf cell :connect-errors) (getf cell :read-errors)
                                        (getf cell :write-errors) (getf cell :timeout-errors)))))
           (flet ((median (store key)
                    (let ((values (sort (mapcar (lambda (results) (getf (nth (position store stores) results) key))
                                                cells)
                                        #'<)))
                      (nth (floor (length values) 2) values))))
             (let ((in-process (median :in-process :requests-per-second))
                   (postgresql (median :postgresql :requests-per-second)))
               (format t "~%Median requests/s: in the process ~D, in PostgreSQL ~D (~,2Fx); ~
                          median p99: ~,2F ms and ~,2F ms.~%~
                          The store adds ~D µs to each request's share of the machine (1/throughput), ~
                          the database sharing its two cores with the server and wrk.~%"
                       (round in-process) (round postgresql) (/ postgresql in-process)
                       (median :in-process :p99-ms) (median :postgresql :p99-ms)
                       (round (* 1000000 (- (/ 1 postgresql) (/ 1 in-process)))))))
           (every (lambda (results)
                    (every (lambda (cell) (and (zerop (getf cell :non-2xx))
                                               (plusp (getf cell :requests-per-second))))
                           results))
                  cells))
      (postgresql-cluster:remove-postgresql-cluster cluster)
      (uiop:delete-directory-tree directory :validate t :if-does-not-exist :ignore))))
