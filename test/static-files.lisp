;;;; Static files served by SERVE-STATIC-FILE and the folder dispatcher, each
;;;; answer checked against what RFC 9110 says it must be.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite static-files :in all :description "Static files: validators, ranges, precompressed files, paths.")
(in-suite static-files)

(defparameter *alphabet* "abcdefghijklmnopqrstuvwxyz")

(defvar *static-folder* nil
  "The folder the current test serves, made by WITH-STATIC-SERVER.")

(defvar *static-dispatcher* nil
  "The folder dispatcher for *STATIC-FOLDER* that the /test/static/ handler calls.")

(defun write-file-octets (path octets)
  (with-open-file (out path :direction :output :element-type '(unsigned-byte 8) :if-exists :supersede)
    (write-sequence octets out)))

(defun big-file-octets ()
  (let ((octets (make-array (* 1024 1024) :element-type '(unsigned-byte 8))))
    (dotimes (index (length octets) octets)
      (setf (aref octets index) (mod (* index 7) 251)))))

(defun make-static-folder ()
  "A new folder holding alphabet.txt (26 octets), data.txt with a data.txt.gz
sibling, big.bin (1 MiB), a directory, a link inside and a link outside."
  (let ((folder (format nil "/tmp/hrt-static-~36R/" (random (expt 2 64) (make-random-state t)))))
    (ensure-directories-exist (concatenate 'string folder "sub/"))
    (write-file-octets (concatenate 'string folder "alphabet.txt") (flex:string-to-octets *alphabet*))
    (write-file-octets (concatenate 'string folder "data.txt") (flex:string-to-octets "plain data"))
    (write-file-octets (concatenate 'string folder "data.txt.gz") (flex:string-to-octets "GZIPPED"))
    (write-file-octets (concatenate 'string folder "big.bin") (big-file-octets))
    (write-file-octets (concatenate 'string folder "sub/inner.txt") (flex:string-to-octets "inner"))
    (uiop:run-program (list "ln" "-s" "/etc/passwd" (concatenate 'string folder "outside")))
    (uiop:run-program (list "ln" "-s" (concatenate 'string folder "alphabet.txt")
                            (concatenate 'string folder "inside")))
    folder))

(ht:define-easy-handler (test-static :uri (lambda (request)
                                            (eql 0 (search "/test/static/" (ht:script-name request)))))
    ()
  (funcall (funcall *static-dispatcher* ht:*request*)))

(defun reply-parts (text)
  "The status, the head and the body of the reply TEXT."
  (let ((head-end (search (crlf-lines "" "") text)))
    (values (parse-integer text :start 9 :end 12)
            (subseq text 0 head-end)
            (subseq text (+ head-end 4)))))

(defun header-value (head name)
  (aref (or (nth-value 1 (cl-ppcre:scan-to-strings (format nil "(?im)^~A:\\s*([^\\r]*)" name) head))
            #(nil))
        0))

(defun static-reply (server method path &rest headers)
  "The status, head and body SERVER answers METHOD PATH with HEADERS."
  (with-connection (socket server)
    (send-text socket (apply #'crlf-lines (format nil "~A ~A HTTP/1.1" method path) "Host: localhost"
                             (append headers '(""))))
    (reply-parts (read-whole-reply socket (string= method "HEAD")))))

(defmacro with-static-server ((var &optional (class ''parallel-easy-acceptor)) &body body)
  "Run BODY with VAR an acceptor of CLASS serving a new static folder under
/test/static/; the folder is removed afterwards."
  `(let ((*static-folder* (make-static-folder)))
     (setf *static-dispatcher* (create-static-folder-dispatcher-and-handler "/test/static/" *static-folder*
                                                                            nil "max-age=60"))
     (unwind-protect
          (with-server (,var (make-server ,class))
            ,@body)
       (uiop:run-program (list "rm" "-rf" *static-folder*)))))

(test static.whole-file-with-validators
  (with-static-server (server)
    (multiple-value-bind (status head body) (static-reply server "GET" "/test/static/alphabet.txt")
      (is (eql 200 status))
      (is (equal *alphabet* body))
      (is (equal "26" (header-value head "Content-Length")))
      (is (equal "bytes" (header-value head "Accept-Ranges")))
      (is (equal "max-age=60" (header-value head "Cache-Control")))
      (is (search "text/plain" (header-value head "Content-Type")))
      (is (parse-http-date* (header-value head "Last-Modified")))
      (is (cl-ppcre:scan "^\"[0-9a-f]+-[0-9a-f]+\"$" (header-value head "ETag")) "~A" head))))

(defun parse-http-date* (text)
  (hunchentoot-recycling-taskmaster::parse-http-date text))

(test static.http-dates-in-all-three-forms
  (let ((time (encode-universal-time 37 49 8 6 11 1994 0)))
    (is (eql time (parse-http-date* "Sun, 06 Nov 1994 08:49:37 GMT")))
    (is (eql time (parse-http-date* "Sunday, 06-Nov-94 08:49:37 GMT")))
    (is (eql time (parse-http-date* "Sun Nov  6 08:49:37 1994")))
    (is (null (parse-http-date* "yesterday")))
    (is (null (parse-http-date* "Sun, 32 Nov 1994 08:49:37 GMT")))))

(test static.if-none-match-lists-and-stars
  (with-static-server (server)
    (let* ((head (nth-value 1 (static-reply server "GET" "/test/static/alphabet.txt")))
           (tag (header-value head "ETag")))
      (dolist (value (list tag (format nil "\"other\", ~A" tag) "*" (format nil "W/~A" tag)))
        (is (eql 304 (static-reply server "GET" "/test/static/alphabet.txt" (format nil "If-None-Match: ~A" value)))
            "If-None-Match: ~A" value))
      (is (eql 304 (static-reply server "HEAD" "/test/static/alphabet.txt" (format nil "If-None-Match: ~A" tag))))
      (is (eql 200 (static-reply server "GET" "/test/static/alphabet.txt" "If-None-Match: \"other\""))))))

(test static.if-modified-since-compared-as-dates
  (with-static-server (server)
    (let* ((head (nth-value 1 (static-reply server "GET" "/test/static/alphabet.txt")))
           (modified (parse-http-date* (header-value head "Last-Modified"))))
      (flet ((status-since (time &rest headers)
               (apply #'static-reply server "GET" "/test/static/alphabet.txt"
                      (format nil "If-Modified-Since: ~A" (ht:rfc-1123-date time)) headers)))
        (is (eql 304 (status-since modified)))
        (is (eql 304 (status-since (+ modified 3600))) "a later date than Last-Modified is not a change")
        (is (eql 200 (status-since (- modified 3600))))
        (is (eql 200 (static-reply server "GET" "/test/static/alphabet.txt" "If-Modified-Since: garbage")))
        (is (eql 200 (status-since (+ modified 3600) "If-None-Match: \"other\""))
            "If-None-Match decides when both are sent")))))

(defun range-reply (server spec)
  "The status, Content-Range and body SERVER answers GET alphabet.txt with
Range: SPEC."
  (multiple-value-bind (status head body)
      (static-reply server "GET" "/test/static/alphabet.txt" (format nil "Range: ~A" spec))
    (list status (header-value head "Content-Range") body)))

(test static.ranges-as-rfc-9110-says
  (with-static-server (server)
    (flet ((range (spec) (range-reply server spec)))
      (is (equal '(206 "bytes 0-4/26" "abcde") (range "bytes=0-4")))
      (is (equal '(206 "bytes 23-25/26" "xyz") (range "bytes=-3")))
      (is (equal '(206 "bytes 20-25/26" "uvwxyz") (range "bytes=20-")))
      (is (equal `(206 "bytes 0-25/26" ,*alphabet*) (range "bytes=0-1000")) "clamped, not 416")
      (is (equal `(206 "bytes 0-25/26" ,*alphabet*) (range "bytes=-100")))
      (is (equal `(200 nil ,*alphabet*) (range "bytes=5-2")) "an invalid range is ignored")
      (is (equal `(200 nil ,*alphabet*) (range "lines=1-2")) "an unknown unit is ignored")
      (is (equal 416 (first (range "bytes=30-"))))
      (is (equal "bytes */26" (second (range "bytes=30-"))))
      (is (equal "bytes */26" (second (range "bytes=-0")))))))

(test static.overlapping-and-adjacent-ranges-are-coalesced
  (with-static-server (server)
    (flet ((range (spec) (range-reply server spec)))
      (is (equal '(206 "bytes 0-7/26" "abcdefgh") (range "bytes=0-4,3-7")))
      (is (equal '(206 "bytes 0-9/26" "abcdefghij") (range "bytes=5-9,0-4")) "adjacent, in any order")
      (is (equal '(206 "bytes 2-6/26" "cdefg") (range "bytes=2-6,3-4")) "one inside another")
      (is (equal `(200 nil ,*alphabet*) (range "bytes=0-,0-")) "more than the file: the file once")
      (is (equal `(200 nil ,*alphabet*) (range "bytes=0-20,10-25")) "31 octets of a 26-octet file")
      (is (equal `(200 nil ,*alphabet*)
                 (range (format nil "bytes=~{~D-~:*~D~^,~}" (loop for i below 17 collect i))))
          "more than 16 ranges: the file once"))))

(defun make-five-megabyte-file ()
  (let ((path (concatenate 'string *static-folder* "five.bin")))
    (write-file-octets path (make-array (* 5 1000 1000) :element-type '(unsigned-byte 8) :initial-element 7))
    (* 5 1000 1000)))

(defun octets-received-for (server request)
  "The number of octets SERVER sends for REQUEST, which asks it to close the
connection after its reply: read to the end of the stream, failing the
test after 60 s."
  (with-connection (socket server)
    (send-text socket request)
    (let ((stream (usocket:socket-stream socket))
          (buffer (make-array 65536 :element-type '(unsigned-byte 8))))
      (handler-case
          (bt:with-timeout (60)
            (loop for count = (read-sequence buffer stream)
                  sum count
                  while (= count (length buffer))))
        ;; The timeout is a SERIOUS-CONDITION, not an ERROR.
        (serious-condition (condition) condition)))))

(test static.amplifying-ranges-send-the-file-once
  ;; 64 overlapping ranges of a 5 MB file asked a server for 64 copies of
  ;; it; nginx sends the file once, and so must we, ten clients at once too.
  (with-static-server (server)
    (let* ((size (make-five-megabyte-file))
           (request (crlf-lines "GET /test/static/five.bin HTTP/1.1" "Host: localhost"
                                (format nil "Range: bytes=~{~A~^,~}" (loop repeat 64 collect "0-"))
                                "Connection: close" ""))
           (one (octets-received-for server request)))
      (is (and (integerp one) (< size one (+ size 1000))) "one client got ~:D octets for a ~:D-octet file" one size)
      (let ((counts (mapcar (lambda (join) (first (funcall join)))
                            (loop repeat 10 collect (in-thread (lambda () (octets-received-for server request)))))))
        (is (every #'integerp counts) "every client read its reply to the end: ~S" counts)
        (when (every #'integerp counts)
          (is (< (reduce #'+ counts) (* 10 (+ size 1000))) "ten clients got ~:D octets in all"
              (reduce #'+ counts)))))))

(test static.hunchentoots-folder-dispatcher-never-sends-a-negative-length
  ;; Hunchentoot's own HANDLE-STATIC-FILE answers bytes=5-2 with 206 and
  ;; Content-Length: -2; under a parallel acceptor the engine drops the
  ;; invalid Range header first (RFC 9110 14.2: ignored), so it answers 200.
  (with-static-server (server)
    ;; Set, not bound: the workers read the global value.
    (let ((dispatch-table ht:*dispatch-table*))
      (push (ht:create-folder-dispatcher-and-handler "/ht-static/" *static-folder*) ht:*dispatch-table*)
      (unwind-protect
       (progn
      (multiple-value-bind (status head body)
          (static-reply server "GET" "/ht-static/alphabet.txt" "Range: bytes=5-2")
        (is (eql 200 status))
        (is (equal "26" (header-value head "Content-Length")))
        (is (equal *alphabet* body)))
      (multiple-value-bind (status head body)
          (static-reply server "GET" "/ht-static/alphabet.txt" "Range: bytes=2-4")
        (is (eql 206 status) "a valid range still reaches it")
        (is (equal "3" (header-value head "Content-Length")))
        (is (equal "cde" body))))
        (setf ht:*dispatch-table* dispatch-table)))))

(test static.several-ranges-as-multipart-byteranges
  (with-static-server (server)
    (multiple-value-bind (status head body)
        (static-reply server "GET" "/test/static/alphabet.txt" "Range: bytes=0-1,-2")
      (is (eql 206 status))
      (let ((boundary (cl-ppcre:register-groups-bind (boundary)
                          ("multipart/byteranges; boundary=(\\S+)" (header-value head "Content-Type"))
                        boundary)))
        (is-true boundary)
        (is (eql (length body) (parse-integer (header-value head "Content-Length"))))
        (is (search (crlf-lines "Content-Range: bytes 0-1/26" "" "ab") body) "~A" body)
        (is (search (crlf-lines "Content-Range: bytes 24-25/26" "" "yz") body))
        (is (search (format nil "--~A--" boundary) body))))))

(test static.if-range
  (with-static-server (server)
    (let* ((head (nth-value 1 (static-reply server "GET" "/test/static/alphabet.txt")))
           (tag (header-value head "ETag")))
      (is (eql 206 (static-reply server "GET" "/test/static/alphabet.txt" "Range: bytes=0-1"
                                 (format nil "If-Range: ~A" tag))))
      (is (eql 206 (static-reply server "GET" "/test/static/alphabet.txt" "Range: bytes=0-1"
                                 (format nil "If-Range: ~A" (header-value head "Last-Modified")))))
      (is (eql 200 (static-reply server "GET" "/test/static/alphabet.txt" "Range: bytes=0-1"
                                 "If-Range: \"other\""))))))

(test static.precompressed-sibling-for-gzip-clients
  (with-static-server (server)
    (multiple-value-bind (status head body)
        (static-reply server "GET" "/test/static/data.txt" "Accept-Encoding: br, gzip")
      (is (eql 200 status))
      (is (equal "GZIPPED" body))
      (is (equal "gzip" (header-value head "Content-Encoding")))
      (is (equal "Accept-Encoding" (header-value head "Vary"))))
    (dolist (accept '(nil "Accept-Encoding: br" "Accept-Encoding: gzip;q=0"))
      (multiple-value-bind (status head body)
          (apply #'static-reply server "GET" "/test/static/data.txt" (and accept (list accept)))
        (is (eql 200 status))
        (is (equal "plain data" body) "~S" accept)
        (is (null (header-value head "Content-Encoding")))
        (is (equal "Accept-Encoding" (header-value head "Vary")))))))

(test static.head-has-no-body
  (with-static-server (server)
    (multiple-value-bind (status head body) (static-reply server "HEAD" "/test/static/alphabet.txt")
      (is (eql 200 status))
      (is (equal "26" (header-value head "Content-Length")))
      (is (equal "" body)))))

(test static.paths-never-leave-the-folder
  (with-static-server (server)
    (dolist (path '("../alphabet.txt" "%2e%2e/alphabet.txt" "%2E%2E%2Falphabet.txt" "..%2falphabet.txt"
                    "sub/../../alphabet.txt" "sub/%2e%2e/%2e%2e/etc/passwd" "..%5calphabet.txt"
                    "%2e%2e%5c%2e%2e%5cetc%5cpasswd" "alphabet.txt%00" "%00" "a%00b" "/etc/passwd"
                    "%2fetc%2fpasswd" "./alphabet.txt" "sub//inner.txt" "sub/" "sub" "outside"
                    "%252e%252e/alphabet.txt" ".%2e/alphabet.txt" "alphabet.txt/" "alphabet.txt/.."
                    "....//alphabet.txt" "%c0%ae%c0%ae/alphabet.txt" "no-such-file"))
      (multiple-value-bind (status head body) (static-reply server "GET" (format nil "/test/static/~A" path))
        (declare (ignore head))
        (is (member status '(400 403 404)) "~A answered ~D" path status)
        (is (not (search "root:" body)) "~A leaked /etc/passwd" path)))
    (is (eql 200 (static-reply server "GET" "/test/static/inside")) "a link inside the folder is followed")
    (is (eql 200 (static-reply server "GET" "/test/static/sub/inner.txt")))))

(defun large-reply (server path)
  "The status and body (octets) SERVER answers GET PATH with, the body read
in one READ-SEQUENCE of its Content-Length: READ-WHOLE-REPLY reads octet by
octet, too slow for a mebibyte on a loaded machine."
  (with-connection (socket server)
    (send-text socket (get-request path))
    (let* ((stream (usocket:socket-stream socket))
           (head (with-output-to-string (out)
                   (loop with tail = 0
                         for octet = (read-byte stream)
                         do (write-char (code-char octet) out)
                            (setf tail (if (member octet '(10 13)) (1+ tail) 0))
                         until (= tail 4))))
           (body (make-array (parse-integer (header-value head "Content-Length"))
                             :element-type '(unsigned-byte 8))))
      (read-sequence body stream)
      (values (parse-integer head :start 9 :end 12) body))))

(test static.large-file-arrives-whole
  (with-static-server (server)
    (multiple-value-bind (status body) (large-reply server "/test/static/big.bin")
      (is (eql 200 status))
      (is (equalp (big-file-octets) body)))))

(test static.same-answers-on-hunchentoot-acceptor
  ;; Not sent by sendfile there, but through Hunchentoot's stream.
  (with-static-server (server 'ht:easy-acceptor)
    (multiple-value-bind (status head body)
        (static-reply server "GET" "/test/static/alphabet.txt" "Range: bytes=-3")
      (is (eql 206 status))
      (is (equal "bytes 23-25/26" (header-value head "Content-Range")))
      (is (equal "xyz" body)))
    (multiple-value-bind (status body) (large-reply server "/test/static/big.bin")
      (is (eql 200 status))
      (is (equalp (big-file-octets) body)))))

(test static.rejects-impossible-folders
  (signals invalid-static-folder (create-static-folder-dispatcher-and-handler "no-slash" "/tmp/"))
  (signals invalid-static-folder (create-static-folder-dispatcher-and-handler "/x/" "/no/such/folder/")))

(test static.truncated-file-ends-the-connection
  ;; The client reads nothing until the file has been cut, so that the
  ;; kernel still has most of it to send: the reply then falls short of
  ;; its Content-Length, and the connection must end there rather than
  ;; carry on as if the next octets were the next reply.
  (let ((size (* 16 1024 1024)))
    (with-static-server (server)
      (let ((path (concatenate 'string *static-folder* "shrinking.bin")))
        (write-file-octets path (make-array size :element-type '(unsigned-byte 8) :initial-element 65))
        (with-connection (socket server)
          (send-text socket (concatenate 'string (get-request "/test/static/shrinking.bin")
                                         (get-request "/test/static/alphabet.txt")))
          (sleep 0.5)
          (uiop:run-program (list "truncate" "-s" "1M" path))
          (let ((stream (usocket:socket-stream socket))
                (received 0)
                (closed-p nil))
            (loop while (or (listen stream) (usocket:wait-for-input socket :timeout 10 :ready-only t))
                  do (if (handler-case (read-byte stream nil) (error () nil))
                         (incf received)
                         (return (setf closed-p t))))
            (is-true closed-p "the connection ended")
            (is (< received size) "~D octets of ~D arrived" received size)
            (is (> received (* 1024 1024)) "what was sent before the cut arrived")))))))

(test static.document-root-is-served-by-the-engine
  ;; An ETag and ranges show SERVE-STATIC-FILE answering, not Hunchentoot's
  ;; HANDLE-STATIC-FILE, which sends neither.
  (let ((folder (make-static-folder)))
    (write-file-octets (concatenate 'string folder "index.html") (flex:string-to-octets "<p>index</p>"))
    (unwind-protect
         (dolist (class '(parallel-easy-acceptor parallel-acceptor))
           (with-server (server (make-server class :document-root (pathname folder)))
             (multiple-value-bind (status head body) (static-reply server "GET" "/alphabet.txt")
               (is (eql 200 status) "~A: ~D" class status)
               (is (equal *alphabet* body))
               (is (header-value head "ETag") "~A: the engine's reply has an ETag" class))
             (multiple-value-bind (status head body) (static-reply server "GET" "/alphabet.txt" "Range: bytes=0-2")
               (declare (ignore head))
               (is (eql 206 status))
               (is (equal "abc" body)))
             (is (equal "<p>index</p>" (nth-value 2 (static-reply server "GET" "/"))) "/ is index.html")
             (is (eql 200 (static-reply server "GET" "/sub/inner.txt")))
             (dolist (path '("/../alphabet.txt" "/sub/../../etc/passwd" "/no-such-file" "/sub/" "/sub"))
               (is (eql 404 (static-reply server "GET" path)) "~A: ~A is 404" class path))
             (when (eq class 'parallel-easy-acceptor)
               (is (equal "Hey!" (nth-value 2 (static-reply server "GET" "/test/yo")))
                   "handlers are dispatched before the document root"))
             (multiple-value-bind (status body) (large-reply server "/big.bin")
               (is (eql 200 status))
               (is (equalp (big-file-octets) body)))))
      (uiop:run-program (list "rm" "-rf" folder)))))
