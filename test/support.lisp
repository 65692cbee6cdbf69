;;;; Servers on free ports, a raw HTTP client, thread accounting, and the
;;;; runner that prints the closing "N passed, M failed" line.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite all :description "Every test of hunchentoot-recycling-taskmaster.")

(defun free-port ()
  "A port the kernel just handed out, closed again for the server to take."
  (let ((socket (usocket:socket-listen "127.0.0.1" 0 :reuseaddress t)))
    (prog1 (usocket:get-local-port socket)
      (usocket:socket-close socket))))

(defun make-server (class &rest initargs)
  "An acceptor of CLASS on a free port of 127.0.0.1, logging nothing unless
INITARGS say otherwise."
  (apply #'make-instance class (append initargs
                                       (list :port 0 :address "127.0.0.1"
                                             :access-log-destination nil
                                             :message-log-destination nil))))

(defun pooled-server (&rest taskmaster-initargs)
  "A PARALLEL-EASY-ACCEPTOR with a RECYCLING-TASKMASTER made of TASKMASTER-INITARGS."
  (make-server 'parallel-easy-acceptor
               :taskmaster (apply #'make-instance 'recycling-taskmaster taskmaster-initargs)))

(defun url (server path)
  (format nil "~:[http~;https~]://127.0.0.1:~D~A"
          (ht:acceptor-ssl-p server) (ht:acceptor-port server) path))

(defun http-get (server path &rest drakma-args)
  "Status code and body of GET PATH, or the condition that made it fail.  A
reply that has not come within 60 s fails: drakma has no read timeout on
SBCL, and a lost request must fail its test, not hang the suite."
  (handler-case
      (bt:with-timeout (60)
        (multiple-value-bind (body status)
            (apply #'drakma:http-request (url server path) :connection-timeout 10 drakma-args)
          (values status body)))
    ;; The timeout is a SERIOUS-CONDITION, not an ERROR.
    (serious-condition (condition) (values nil condition))))

(defun stats (server key)
  (getf (taskmaster-statistics server) key))

(defun wait-until (predicate &key (timeout 10) (interval 0.02))
  "True as soon as PREDICATE is, false if it is still false after TIMEOUT seconds."
  (loop with deadline = (+ (get-internal-real-time) (* timeout internal-time-units-per-second))
        when (funcall predicate) return t
        when (> (get-internal-real-time) deadline) return nil
        do (sleep interval)))

(defun threads-started-since (threads-before)
  "The live threads that are not among THREADS-BEFORE."
  (set-difference (bt:all-threads) threads-before))

(defmacro with-thread-leak-check (() &body body)
  "Run BODY, then check that every thread it started has ended, by identity:
a thread BODY leaked is not hidden by one that ended meanwhile."
  (let ((before (gensym "BEFORE")))
    `(let ((,before (bt:all-threads)))
       (multiple-value-prog1 (progn ,@body)
         (is (wait-until (lambda () (null (threads-started-since ,before))) :timeout 10)
             "thread leak: ~{~A~^, ~} still alive"
             (mapcar #'bt:thread-name (threads-started-since ,before)))))))

(defvar *budgets-in-use* '()
  "The memory budgets of the acceptors WITH-SERVER has started and not yet
stopped, innermost first.")

(defun started-memory-budget (server)
  "The MEMORY-BUDGET of SERVER's run, a started parallel acceptor; NIL for
any other acceptor."
  (let* ((taskmaster (ht::acceptor-taskmaster server))
         (engine (and (typep taskmaster 'recycling-taskmaster) (hrt::taskmaster-engine taskmaster)))
         (set (and engine (hrt::engine-readiness-set engine))))
    (and set (hrt::readiness-set-memory-budget set))))

(defun check-budget-holds-nothing (budget)
  "Once its server has stopped, BUDGET is to hold 0 octets: everything it
counted was given back.  Not asked while a server started around it shares
BUDGET."
  (when (and budget (not (member budget *budgets-in-use*)))
    (is (wait-until (lambda () (zerop (hrt::memory-budget-used budget))) :timeout 5)
        "the memory budget holds ~D octets once the server has stopped" (hrt::memory-budget-used budget))))

(defmacro with-server ((var form) &body body)
  "Start the acceptor FORM as VAR for BODY; stop it afterwards, by force if
STOP fails; then check that its memory budget holds nothing
(CHECK-BUDGET-HOLDS-NOTHING)."
  (let ((budget (gensym "BUDGET")))
    `(let ((,var ,form))
       (ht:start ,var)
       (let ((,budget (started-memory-budget ,var)))
         (unwind-protect (let ((*budgets-in-use* (cons ,budget *budgets-in-use*)))
                           ,@body)
           (when (ht:started-p ,var)
             (handler-case (ht:stop ,var)
               (error () (abandon-acceptor ,var))))
           (check-budget-holds-nothing ,budget))))))

(defun in-thread (function)
  "Run FUNCTION in a new thread; returns a function that joins it and returns
its values as a list."
  (let ((thread (bt:make-thread (lambda () (multiple-value-list (funcall function)))
                                :name "test client")))
    (lambda () (bt:join-thread thread))))

;;; A raw client, for what drakma hides: exact bytes, keep-alive, many sockets.

(defun connect-to-port (port)
  (usocket:socket-connect "127.0.0.1" port :element-type '(unsigned-byte 8)))

(defun connect (server)
  (connect-to-port (ht:acceptor-port server)))

(defun send-text (socket text)
  (let ((stream (usocket:socket-stream socket)))
    (write-sequence (flex:string-to-octets text :external-format :utf-8) stream)
    (finish-output stream)))

(defun crlf-lines (&rest lines)
  (format nil "~{~A~C~C~}" (loop for line in lines collect line collect #\Return collect #\Linefeed)))

(defun response-complete-p (octets)
  "Length of the first complete response (head and Content-Length body) at the
start of OCTETS, or NIL."
  (let ((head-end (search #(13 10 13 10) octets)))
    (when head-end
      (let* ((head (flex:octets-to-string octets :end head-end :external-format :latin-1))
             (length-match (nth-value 1 (cl-ppcre:scan-to-strings
                                         "(?im)^content-length:\\s*(\\d+)" head)))
             (body-length (if length-match (parse-integer (aref length-match 0)) 0))
             (total (+ head-end 4 body-length)))
        (when (<= total (length octets))
          total)))))

(defun read-response (socket &key (timeout 10))
  "Status code, body and head (strings) of one Content-Length response read
from SOCKET; NIL on EOF or timeout."
  (let ((stream (usocket:socket-stream socket))
        (octets (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t))
        (deadline (+ (get-internal-real-time) (* timeout internal-time-units-per-second))))
    (loop
      (let ((total (response-complete-p octets)))
        (when total
          (let* ((text (flex:octets-to-string octets :end total :external-format :utf-8))
                 (body-start (+ 4 (search (coerce '(#\Return #\Linefeed #\Return #\Linefeed) 'string) text))))
            (return (values (parse-integer text :start 9 :end 12)
                            (subseq text body-start)
                            (subseq text 0 body-start))))))
      (when (> (get-internal-real-time) deadline)
        (return nil))
      (if (usocket:wait-for-input socket :timeout 0.1 :ready-only t)
          (let ((byte (read-byte stream nil)))
            (if byte (vector-push-extend byte octets) (return nil)))))))

(defun closed-by-server-p (socket)
  "True when the server closes SOCKET within two seconds: an end of file,
or a reset (a close with octets of the client's unread), which SBCL may
signal from the wait as well as from the read."
  (handler-case (and (usocket:wait-for-input socket :timeout 2 :ready-only t)
                     (null (read-byte (usocket:socket-stream socket) nil)))
    (stream-error () t)))

;;; Reading many sockets at once, by their descriptors.

(defun reset-socket (socket)
  "Close SOCKET with a reset instead of a FIN: SO_LINGER on, for 0 s."
  (let ((fd (sb-bsd-sockets:socket-file-descriptor (usocket:socket socket))))
    (sb-alien:with-alien ((linger (array sb-alien:int 2)))
      (setf (sb-alien:deref linger 0) 1 (sb-alien:deref linger 1) 0)
      ;; SOL_SOCKET 1, SO_LINGER 13 on Linux.
      (sb-alien:alien-funcall (sb-alien:extern-alien "setsockopt"
                                                     (function sb-alien:int sb-alien:int sb-alien:int sb-alien:int
                                                               (* t) sb-alien:unsigned))
                              fd 1 13 (sb-alien:cast (sb-alien:addr linger) (* t)) 8))
    (usocket:socket-close socket)))

(defstruct (octets-reader (:constructor make-octets-reader (socket)))
  "What has been read of a socket so far (START-OCTETS-READERS)."
  socket
  (octets 0)
  ;; Events and comments: the blank lines that end them.
  (events 0)
  (last 0)
  ;; The first octets read, up to 256.
  (start (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t))
  (ended-p nil))

(defun count-blank-lines (buffer count last)
  "The LF LF pairs among the first COUNT octets of BUFFER, the octet before
them LAST; second value, the last of them."
  (declare (type (simple-array (unsigned-byte 8) (*)) buffer) (type fixnum count)
           (type (unsigned-byte 8) last) (optimize speed))
  (let ((pairs 0))
    (declare (type fixnum pairs))
    (dotimes (i count (values pairs last))
      (let ((octet (aref buffer i)))
        (when (and (= octet 10) (= last 10))
          (incf pairs))
        (setf last octet)))))

(defun read-available (reader buffer)
  "Read what READER's socket, non-blocking, has now, counting it; true when
something came.  At its end, READER is marked ended."
  (let ((count (hrt::receive-available (sb-bsd-sockets:socket-file-descriptor (usocket:socket (octets-reader-socket reader)))
                                       buffer 0 (length buffer))))
    (cond ((eq count :would-block) nil)
          ((or (eq count :error) (zerop count)) (setf (octets-reader-ended-p reader) t) nil)
          (t (loop for i below (min count (- 256 (length (octets-reader-start reader))))
                   do (vector-push-extend (aref buffer i) (octets-reader-start reader)))
             (multiple-value-bind (pairs last) (count-blank-lines buffer count (octets-reader-last reader))
               (incf (octets-reader-events reader) pairs)
               (setf (octets-reader-last reader) last))
             (incf (octets-reader-octets reader) count)
             t))))

(defun octets-reader-status (reader)
  "The status of the reply whose first octets READER read, or NIL."
  (let ((start (octets-reader-start reader)))
    (and (>= (length start) 12)
         (parse-integer (map 'string #'code-char (subseq start 9 12)) :junk-allowed t))))

(defun start-octets-readers (sockets)
  "An OCTETS-READER for each of SOCKETS, read as fast as they come by one
thread, until each has ended.  The sockets are read by their descriptors,
never their Lisp streams, without waiting (recv(2) with MSG_DONTWAIT)."
  (let ((readers (mapcar #'make-octets-reader sockets)))
    (bt:make-thread
     (lambda ()
       (let ((buffer (make-array 65536 :element-type '(unsigned-byte 8))))
         (loop for open = (remove-if #'octets-reader-ended-p readers)
               while open
               do (when (zerop (loop for reader in open
                                     count (read-available reader buffer)))
                    (sleep 0.001)))))
     :name "test octets reader")
    readers))

(defun budgeted-event-server (octets)
  "An event server, as EVENT-SERVER, with a memory budget of OCTETS of its own."
  (make-server 'parallel-easy-acceptor :memory-budget octets
               :taskmaster (make-instance 'recycling-taskmaster :standby-thread-count 2 :max-thread-count 4
                                                                :stop-timeout 5)))

;;; Processes of the tests' own: the demo, and ending them by PID.

(defun log-lines-matching (file text)
  (with-open-file (in file :if-does-not-exist nil)
    (if in (loop for line = (read-line in nil) while line count (search text line)) 0)))

(defun last-lines-with (file texts &key (count 5))
  "The last COUNT lines of FILE containing one of TEXTS, a string of them
one a line, for a failure's message; empty when FILE is not there."
  (let ((lines '()))
    (with-open-file (in file :if-does-not-exist nil)
      (when in
        (loop for line = (read-line in nil) while line
              when (some (lambda (text) (search text line)) texts)
                do (push line lines))))
    (format nil "~{~A~^~%~}" (reverse (subseq lines 0 (min count (length lines)))))))

(defun stop-process (process)
  "End PROCESS, which this test started: TERM, then KILL after 10 s."
  (when (uiop:process-alive-p process)
    (uiop:terminate-process process)
    (unless (wait-until (lambda () (not (uiop:process-alive-p process))) :timeout 10)
      (uiop:terminate-process process :urgent t)))
  (uiop:wait-process process))

(defun launch-demo (port log &key (environment (sb-ext:posix-environ)) dynamic-space-megabytes)
  "The demo of `make run` serving PORT in an SBCL of its own with
ENVIRONMENT (and a heap of DYNAMIC-SPACE-MEGABYTES, when given), writing to
LOG; its process-info once it says it serves, or NIL (it is ended)."
  (let ((process (uiop:launch-program
                  (append (list "sbcl")
                          (and dynamic-space-megabytes
                               (list "--dynamic-space-size" (format nil "~DMB" dynamic-space-megabytes)))
                          (list "--noinform" "--non-interactive" "--disable-debugger"
                                "--load" (namestring (asdf:system-relative-pathname "hunchentoot-recycling-taskmaster"
                                                                                    "tools/setup.lisp"))
                                "--eval" "(load-systems-quietly \"hunchentoot-recycling-taskmaster/demo\")"
                                "--eval" (format nil "(hunchentoot-recycling-taskmaster-demo:main :port ~D)" port)))
                  :output log :error-output :output :if-output-exists :supersede
                  :environment environment)))
    (if (wait-until (lambda () (plusp (log-lines-matching log "Serving"))) :timeout 120 :interval 0.1)
        process
        (progn (stop-process process) nil))))

;;; Certificates for the HTTPS tests, made with the openssl CLI.

(defvar *certificate-directory* nil)

(defun make-scratch-folder ()
  "A new empty folder of the system's temporary ones, as a namestring
ending in a slash."
  (format nil "~A/" (string-right-trim '(#\Newline) (uiop:run-program '("mktemp" "-d") :output :string))))

(defun certificate-files ()
  "Certificate and key files for 127.0.0.1, made once per test run."
  (unless *certificate-directory*
    (let ((directory (make-scratch-folder)))
      (uiop:run-program (list "openssl" "req" "-x509" "-newkey" "rsa:2048" "-nodes"
                              "-keyout" (concatenate 'string directory "key.pem")
                              "-out" (concatenate 'string directory "cert.pem")
                              "-days" "2" "-subj" "/CN=127.0.0.1")
                        :error-output nil :output nil)
      (setf *certificate-directory* directory)))
  (values (concatenate 'string *certificate-directory* "cert.pem")
          (concatenate 'string *certificate-directory* "key.pem")))

;;; The runner.

(defun one-line (text)
  "TEXT with each run of spaces and line breaks made one space, trimmed."
  (with-output-to-string (out)
    (let ((gap nil) (begun nil))
      (loop for char across text
            do (if (member char '(#\Space #\Newline #\Tab))
                   (setf gap begun)
                   (progn (when gap (write-char #\Space out))
                          (write-char char out)
                          (setf gap nil begun t)))))))

(defun failure-lines (results)
  "One line for each failed check in RESULTS: the test's name and its
reason on one line (FiveAM's own reasons span several), shortened to 300
characters."
  (loop for result in results
        unless (typep result 'fiveam::test-passed)
          collect (let ((reason (one-line (or (ignore-errors (princ-to-string (fiveam::reason result))) ""))))
                    (format nil "~A: ~A"
                            (ignore-errors (fiveam::name (fiveam::test-case result)))
                            (subseq reason 0 (min 300 (length reason)))))))

(defun run-tests (&optional (suite-name "ALL") label)
  "Run the suite named SUITE-NAME (default every test); print one closing line
\"N passed, M failed\", after LABEL and a colon when given.  True when none
failed; second and third values, the checks passed and failed; fourth, a
line for each failed check (FAILURE-LINES), which the runner prints again
beside the closing line, where a CI log's excerpt will show them."
  (let* ((results (let ((*print-names* t))
                    (run (intern (string-upcase suite-name) '#:hunchentoot-recycling-taskmaster-test))))
         (passed (count-if (lambda (result) (typep result 'fiveam::test-passed)) results))
         (failed (- (length results) passed)))
    (explain! results)
    (format t "~&~@[~A: ~]~D passed, ~D failed~%" label passed failed)
    (finish-output)
    (values (zerop failed) passed failed (failure-lines results))))
